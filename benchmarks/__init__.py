"""Paper protocols and comparisons, kept out of the installed package (as Pyro keeps ``examples/``).

Each script prints one table (``python benchmarks/NAME.py``; the last tables are in
``results/``). Shared pieces, imported by the scripts, the tutorials and the tests from a source
checkout (with the repository root on ``sys.path``):

- `benchmarks.ood`: distribution-shift and out-of-distribution inputs for the digits benchmarks
  (rotated digits, uniform noise, permuted pixels, scaled ``δ·x``, held-out classes);
- `benchmarks.protocols`: the Ensemble Model Patching protocol (the BatchNorm MLP and how every
  method is trained).
"""
