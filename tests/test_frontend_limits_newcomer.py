"""What a newcomer hit following the README (issue 19): the demo model says its weights are
random, the README's design link resolves inside a clone, and the Ray docs agree on what a
`ray job submit` needs."""

from __future__ import annotations

import re
from pathlib import Path

from kvloom.cluster import cli
from kvloom.cluster.demo_model import RANDOM_WEIGHTS_NOTE, is_demo_model

ROOT = Path(__file__).resolve().parent.parent


def test_demo_model_says_its_weights_are_random(tmp_path, capsys, demo_tokenizer_dir):
    assert cli.main(["demo-model", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert f"note: {RANDOM_WEIGHTS_NOTE}" in out and "random" in RANDOM_WEIGHTS_NOTE
    assert is_demo_model(tmp_path / "demo") and is_demo_model(demo_tokenizer_dir)
    assert not is_demo_model(tmp_path)  # no config.json: not a demo model


def test_readme_links_resolve_inside_the_repository():
    readme = (ROOT / "README.md").read_text()
    assert "../shared" not in readme
    assert "docs/architecture.md" in readme
    for target in re.findall(r"\]\(((?:docs|helm|benchmarks)/[^)#]+)", readme):
        assert (ROOT / target).exists(), target


def test_ray_docs_agree_on_job_submission():
    ray_doc = (ROOT / "docs" / "ray.md").read_text()
    deploy_doc = (ROOT / "docs" / "deploy.md").read_text()
    for doc in (ray_doc, deploy_doc):
        assert '"pip": ["kvloom"]' not in doc  # kvloom is not on any package index
        assert "not on PyPI" in doc
    assert "works as `--working-dir .`" not in ray_doc
    assert "not a kvloom checkout" in ray_doc and "not a kvloom" in deploy_doc
