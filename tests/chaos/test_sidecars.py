"""``bench.chaos --sidecar dynamo`` and the common topology, without processes: the flags, what the topology runs
(Dynamo's own TensorRT-LLM sidecar where ours ran, TensorRT-LLM's engines, no LoRA, round-robin), the templates both
sidecars serve, and the block each run writes into ``docs/comparison.md``. The soak itself is
``tests/chaos/test_chaos.py``'s; these runs are ``python -m bench.chaos --minutes 10 [--sidecar dynamo]``."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench._chaos_report import comparison_markers, write_block
from bench._chaos_topology import LORA, PD_MODEL, build
from bench.chaos import parse_args, templates_for
from tests.cluster.network import Host, Network
from tests.helpers.stack import MODEL

ROOT = Path(__file__).resolve().parents[2]


def _loopback() -> Network:
    return Network("loopback", {"e1": Host("e1", "127.0.0.1")}, reason="loopback")


def test_dynamos_sidecar_runs_on_the_common_topology_only() -> None:
    assert (parse_args([]).sidecar, parse_args([]).topology) == ("ours", "full")
    args = parse_args(["--sidecar", "dynamo"])
    assert (args.sidecar, args.topology) == ("dynamo", "common")
    assert parse_args(["--topology", "common"]).sidecar == "ours"
    for argv in (["--sidecar", "dynamo", "--topology", "full"], ["--topology", "common", "--write-docs"]):
        with pytest.raises(SystemExit) as refused:
            parse_args(argv)
        assert refused.value.code == 2


def test_the_common_topology_runs_dynamos_sidecar_on_tensorrt_llms_engines_without_lora(tmp_path: Path) -> None:
    topo = build(tmp_path, "file", _loopback(), "proxy", sidecar="dynamo", kind="common")
    assert topo.models == {MODEL, PD_MODEL}
    assert topo.lora_root is None
    for worker in topo.workers.values():
        argv = worker.sidecar.argv(1)
        assert argv[1:3] == ["-m", "dynamo.trtllm.sidecar"], argv
        # Named after its relative --model-path: a link in its working directory to the test model.
        model = argv[argv.index("--model-path") + 1]
        assert model == worker.model
        assert worker.sidecar.cwd is not None
        assert (worker.sidecar.cwd / model / "config.json").exists()
        engine = worker.engine.managed.argv(1)
        assert engine[engine.index("--profile") + 1] == "trtllm"
        assert "--capability" not in engine
        assert "--kv-events" not in engine
    assert topo.workers["pd-prefill"].sidecar.argv(1)[-2:] == ["--disaggregation-mode", "prefill"]
    for frontend in topo.frontends.values():
        assert "--router-mode" not in frontend.managed.argv(1)


def test_ours_on_the_common_topology_differs_from_dynamos_only_by_the_sidecar(tmp_path: Path) -> None:
    ours = build(tmp_path / "ours", "file", _loopback(), "proxy", sidecar="ours", kind="common")
    theirs = build(tmp_path / "theirs", "file", _loopback(), "proxy", sidecar="dynamo", kind="common")
    for name, worker in ours.workers.items():
        argv = worker.sidecar.argv(1)
        assert argv[1:3] == ["-m", "sidecar"]
        assert "--lora-root" not in argv
        engine = [a for a in worker.engine.managed.argv(1) if not a.isdigit() and "/" not in a]
        other = [a for a in theirs.workers[name].engine.managed.argv(1) if not a.isdigit() and "/" not in a]
        assert engine == other, name
    full = build(tmp_path / "full", "file", _loopback(), "proxy")
    assert full.models == {MODEL, LORA, PD_MODEL}
    assert "--lora-root" in full.workers["w1"].sidecar.argv(1)


def test_the_common_templates_are_the_catalogues_without_lora_and_n_above_one() -> None:
    common = templates_for(1, "common")
    full = templates_for(1, "full")
    assert common == [t for t in full if t.model_kind != "lora" and t.n == 1]
    assert {t.model_kind for t in common} == {"base", "pd"}
    assert any(t.directive for t in common), "the error windows still have their templates"


def test_each_sidecars_soak_has_its_block_in_the_comparison(tmp_path: Path) -> None:
    document = (ROOT / "docs" / "comparison.md").read_text()
    for sidecar in ("ours", "dynamo"):
        begin, end = comparison_markers(sidecar, "common", "file")
        assert begin in document, sidecar
        assert end in document, sidecar
    copy = tmp_path / "comparison.md"
    copy.write_text(document)
    around = comparison_markers("dynamo", "common", "file")
    write_block(copy, around, f"{around[0]}\nnew figures\n{around[1]}")
    rewritten = copy.read_text()
    assert "new figures" in rewritten
    assert rewritten.replace(f"{around[0]}\nnew figures\n{around[1]}", "") == document.replace(
        document[document.index(around[0]) : document.index(around[1]) + len(around[1])], ""
    ), "only the block changed"
