"""Research studies around ``fp8_comm_hook``: the convergence comparison, the error table and what
error feedback does along a fixed trajectory. Not part of the installed package; run the scripts
from the repository root (``python studies/compare_convergence.py``, ...). See ``docs/convergence.md``
and ``docs/numerics.md``."""
