"""Rule definitions, one module per section of the rule catalog (docs/rules.md)."""
