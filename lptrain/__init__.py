"""lptrain: low-precision LLM pretraining with validated flags and CPU-provable numerics.

Importing lptrain is cheap and never imports Transformer Engine: the TE backend is loaded
only when a run selects it.

The packages are layered, and each imports only the layers to its right in :data:`LAYERS`:
the front door (``cli``, ``launch``, ``testing``) -> ``train`` -> ``memory``, ``interop`` ->
``optim`` -> ``distributed`` -> ``model`` -> ``precision`` -> ``checkpoint`` -> ``config`` ->
``data`` -> ``catalog``, ``errors``. No cycles between packages, and no private name is
imported across packages (``tests/unit/test_import_layers.py`` holds all three).
"""

__version__ = "0.1.0"

# Top to bottom; a unit may import units of its own layer only without forming a cycle.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__", "cli", "launch", "testing"),
    ("train",),
    ("memory", "interop"),
    ("optim",),
    ("distributed",),
    ("model",),
    ("precision",),
    ("checkpoint",),
    ("config",),
    ("data",),
    ("catalog", "errors"),
)
