"""``import pyro_subspace`` loads torch and Pyro, not the heavy optional stacks.

arviz (with xarray, pandas and matplotlib: 1.2 s and 135 MiB here), scikit-learn (100 MiB) and
SciPy are imported by the functions that use them, on first use; a process that fits a Laplace
posterior or runs a sampler never pays for them (the 1000-class K-FAC head's peak RSS counted
them as the library's own memory).
"""

import subprocess
import sys

import pytest

HEAVY = ("arviz", "xarray", "pandas", "matplotlib", "sklearn", "scipy")


def _loaded_after(code: str) -> set[str]:
    probe = f"import sys\n{code}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_importing_the_package_loads_no_heavy_optional_stack():
    assert _loaded_after("import pyro_subspace, pyro_subspace.infer, pyro_subspace.nn") == set()


@pytest.mark.parametrize(
    "code, needs",
    [
        ("from pyro_subspace import datasets; datasets.load('diabetes')", {"sklearn"}),
        ("from pyro_subspace import convert; convert.az", {"arviz"}),
    ],
)
def test_each_stack_is_imported_by_the_function_that_uses_it(code, needs):
    assert needs <= _loaded_after("import pyro_subspace\n" + code.replace("; ", "\n"))


def test_convert_az_is_arviz_once_read():
    import arviz

    from pyro_subspace import convert

    assert convert.az is arviz
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        convert.nope  # noqa: B018
