"""Test support shipped with the package (importable by tests of every package).

``lptrain.testing.dist`` runs a function on several ``torch.distributed`` gloo ranks on the
local CPU, so multi-process behaviour (amax all-reduce, data-parallel sharding, the
data-parallel engine) is tested with real processes and real collectives.
"""
