"""`localllm bench` offline: the KV cache type options (-ctk/-ctv, as run and serve spell them), context
depth (-d), and what it hands a llama-bench binary, on a tiny head-size-32 model and a fake llama-bench."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
from tiny_arch import Shape, write_arch_model
from typer.testing import CliRunner

from localllm.errors import ConfigError

HD32 = Shape(dim=128, heads=4, kv_heads=2, head_dim=32)  # q8_0 needs head sizes divisible by 32

# A stand-in llama-bench: records its argv, answers one JSON row per requested test as llama-bench -o json.
FAKE_LLAMA_BENCH = """#!{python}
import json, sys
args = sys.argv[1:]
opt = lambda flag: args[args.index(flag) + 1]
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
lists = {{k: [int(x) for x in opt(k).split(",")] for k in ("-p", "-n", "-d")}}
rows = [dict(n_prompt=p, n_gen=0, n_depth=d) for p in lists["-p"] if p for d in lists["-d"]]
rows += [dict(n_prompt=0, n_gen=n, n_depth=d) for n in lists["-n"] if n for d in lists["-d"]]
for r in rows:
    r.update(n_threads=int(opt("-t")), avg_ts=100.0, samples_ts=[99.0, 101.0],
             type_k=opt("-ctk"), type_v=opt("-ctv"))
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def hd32_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_arch_model(
        tmp_path_factory.mktemp("bench") / "qwen2-hd32.gguf", "qwen2", n_layers=2, shape=HD32
    )


@pytest.fixture
def bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Runs `localllm bench ARGS` in-process with a private model home; returns the result."""
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-bench found unless given
    from localllm.cli import bench as _  # noqa: F401  (registers the bench group)
    from localllm.cli.app import app

    return lambda *args: CliRunner().invoke(app, ["bench", *args])


def _json(result: Any) -> dict[str, Any]:
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


def test_q8_0_cache_types_and_depth_reach_the_engine_and_the_table(bench: Any, hd32_path: Path) -> None:
    common = [str(hd32_path), "--backend", "numpy", "-t", "1", "-r", "1", "-p", "8", "-n", "4", "-d", "0,24"]
    data = _json(bench(*common, "-ctk", "q8_0", "-ctv", "q8_0", "-o", "json"))
    rows = data["results"]
    assert [r["test"] for r in rows] == ["pp8", "tg4", "tg4@d24"]
    assert all((r["type_k"], r["type_v"]) == ("q8_0", "q8_0") and r["tokens_per_s"] > 0 for r in rows)
    table = bench(*common, "--cache-type-k", "f32", "--cache-type-v", "f16", "-o", "md", "-d", "0")
    assert table.exit_code == 0, table.output
    header, _, first = table.stdout.splitlines()[:3]
    kv = header.split(" | ").index("KV")
    assert first.split(" | ")[kv] == "f32/f16" and "| tg4 |" in table.stdout


def test_an_unknown_cache_type_is_refused_before_any_test(bench: Any, hd32_path: Path) -> None:
    result = bench(str(hd32_path), "--backend", "numpy", "-ctv", "q4_0")
    assert result.exit_code != 0 and result.stdout == ""  # the CLI's entry point prints this one line
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception).startswith("KV cache type 'q4_0' is not supported")


def test_llama_bench_gets_the_same_cache_types_and_depths(
    bench: Any, hd32_path: Path, tmp_path: Path
) -> None:
    log = tmp_path / "llama-bench.log"
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, log=str(log)))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    args = ["--backend", "numpy", "-t", "1", "-r", "1", "-p", "8", "-n", "4", "-d", "0,24", "-ctk", "q8_0"]
    data = _json(bench(str(hd32_path), *args, "--llama-bench", str(fake), "-o", "json"))
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(c[c.index("-ctk") + 1] == "q8_0" and c[c.index("-ctv") + 1] == "f16" for c in calls)
    # its -d would apply to its pp tests too: they run at depth 0 only, as ours do
    assert [(c[c.index("-p") + 1], c[c.index("-d") + 1]) for c in calls] == [("8", "0"), ("0", "0,24")]
    theirs = [r for r in data["results"] if r["engine"] == "llama.cpp"]
    assert [(r["test"], r["type_k"], r["type_v"]) for r in theirs] == [
        ("pp8", "q8_0", "f16"),
        ("tg4", "q8_0", "f16"),
        ("tg4@d24", "q8_0", "f16"),
    ]
    assert {r["test"] for r in data["ratios"]} == {"pp8", "tg4", "tg4@d24"}


def test_one_engine_at_a_time_across_thread_counts(
    bench: Any, hd32_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-t 1,2` closes and frees the first thread count's engine before loading the next: two engines
    alive would map the weights twice and double the peak RSS bench reports."""
    import gc
    import weakref

    from localllm.engine import engine as engine_module

    real, alive_at_load = engine_module.LLMEngine, []
    engines: list[weakref.ref] = []

    def tracked(config: Any) -> Any:
        gc.collect()
        alive_at_load.append(sum(ref() is not None for ref in engines))
        made = real(config)
        engines.append(weakref.ref(made))
        return made

    monkeypatch.setattr(engine_module, "LLMEngine", tracked)
    rows = _json(
        bench(
            str(hd32_path), "--backend", "numpy", "-t", "1,2", "-r", "1", "-p", "8", "-n", "4", "-o", "json"
        )
    )
    assert [(r["test"], r["threads"]) for r in rows["results"]] == [
        ("pp8", 1),
        ("tg4", 1),
        ("pp8", 2),
        ("tg4", 2),
    ]
    assert alive_at_load == [0, 0]


def test_decode_bytes_count_the_routed_experts_share(tmp_path: Path) -> None:
    """A MoE decode step reads experts_used of expert_count experts: the bandwidth column counts those
    bytes, not the whole file's (which read 130 GB/s on a 2-core machine)."""
    from tiny_gptoss import write_gptoss

    from localllm.bench.offline import decode_weight_bytes
    from localllm.loading.file import GGUFFile

    gf = GGUFFile.open(write_gptoss(tmp_path / "gptoss.gguf"))
    experts, used = gf.arch_get("expert_count"), gf.arch_get("expert_used_count")
    assert 0 < used < experts
    routed = sum(t.nbytes for n, t in gf.tensors.items() if "_exps." in n)
    rest = sum(t.nbytes for n, t in gf.tensors.items() if "_exps." not in n and n != "token_embd.weight")
    tied = 0 if "output.weight" in gf.tensors else gf.tensors["token_embd.weight"].nbytes
    assert routed > 0
    assert decode_weight_bytes(gf) == rest + tied + routed * used // experts
