"""The rendered chart matches the committed golden manifests under tests/golden/helm/.

Rendered by Helm's own engine (helm-python-sdk 0.2.2, Helm v4.2.3; see tests/helm_render.py)
with release name "kvloom" in namespace "llm", for the chart defaults and each example values
file. Any change to the chart's output must come with updated golden files, so reviewers see
the manifests change. After an intended change, regenerate and review the diff:

    KVLOOM_UPDATE_GOLDEN=1 pytest tests/test_helm_golden.py
"""

from __future__ import annotations

import difflib
import os

import pytest
from helm_render import GOLDEN_DIR, VALUE_SETS, load_values, manifest_text, render

REGENERATE = "KVLOOM_UPDATE_GOLDEN=1 pytest tests/test_helm_golden.py"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_render_matches_golden(name):
    actual = manifest_text(render(load_values(name)))
    golden = GOLDEN_DIR / f"{name}.yaml"
    if os.environ.get("KVLOOM_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(actual)
    assert golden.exists(), f"no golden file {golden}; create it with: {REGENERATE}"
    expected = golden.read_text()
    if actual != expected:
        diff = difflib.unified_diff(
            expected.splitlines(keepends=True),
            actual.splitlines(keepends=True),
            fromfile=f"golden/{name}.yaml",
            tofile=f"rendered/{name}.yaml",
        )
        pytest.fail(
            f"the chart's render for {name!r} drifted from {golden}.\n"
            f"If the change is intended, regenerate and commit the golden files:\n"
            f"    {REGENERATE}\n\n" + "".join(list(diff)[:200]),
            pytrace=False,
        )
