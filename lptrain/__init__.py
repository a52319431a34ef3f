"""lptrain: low-precision LLM pretraining with validated flags and CPU-provable numerics.

Importing lptrain is cheap and never imports Transformer Engine: the TE backend is loaded
only when a run selects it.
"""

__version__ = "0.1.0"
