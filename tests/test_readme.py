"""The README's example runs (with fewer epochs and draws) and produces what it promises."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL).group(1)
    code = code.replace("epochs=1000", "epochs=20").replace("swa_epochs=50", "swa_epochs=12")
    code = code.replace("num_samples=300, warmup_steps=100", "num_samples=15, warmup_steps=5")
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - the README is ours
    idata = namespace["idata"]
    assert idata.posterior["t"].shape == (1, 15, 10)
    assert idata.log_likelihood["obs"].shape == (1, 15, 400)
