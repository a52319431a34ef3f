"""Rule definitions, one module per section of the rule catalog (flag-rules.md)."""
