"""Facts that configuration and execution share, as plain torch-free data (a leaf package).

Both :mod:`lptrain.config` (schema choices, rules, the ``docs/rules.md`` page) and the
packages that run a config (:mod:`lptrain.precision`, :mod:`lptrain.optim`) read these
modules, so validation and execution cannot disagree and neither imports the other for them:

* :mod:`lptrain.catalog.recipes`: one entry per quantized-GEMM recipe (formats, alignments,
  hardware and Transformer Engine minima, the TE and emulated recipe classes);
* :mod:`lptrain.catalog.ns_coefficients`: Muon's Newton-Schulz coefficient sets and their
  step-count rules;
* :mod:`lptrain.catalog.muon_scaling`: Muon's update scale modes and the update RMS they give;
* :mod:`lptrain.catalog.gpus`: the GPUs (memory, dense peak FLOP/s per GEMM precision) that the
  memory planner's targets, the MFU figures and the virtual GPU read.

Nothing here imports torch or any other lptrain package. The readers take what they need when
they are imported (the schema's value sets, the rules and their documentation texts), so an
entry present then -- an edit of the file, or a test's patch before the first import -- is
seen by every one of them.
"""
