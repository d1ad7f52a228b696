"""`kvchat bench latency` (issue 43): a message after N cached tokens, timed to its logits, per cache mode and N."""
import json
import os
import subprocess
import sys

import pytest

from kernel_cache import seeded


def test_latency_json_has_every_mode_and_length_and_stdout_clean(tmp_path):
    # a cache of its own, holding the kernels the session built (not compiled again in the child)
    env = dict(os.environ, KVCHAT_CACHE_DIR=str(seeded(tmp_path / "cache")), OMP_NUM_THREADS="1")
    env.pop("KVCHAT_BENCH_QUIET", None)
    run = subprocess.run([sys.executable, "-m", "kvchat.cli.main", "bench", "latency", "--json", "--model",
                          "preset:tiny:Q4_0", "--contexts", "32,64", "--message-tokens", "8", "--modes", "bf16,int8",
                          "--runs", "2", "--no-llamacpp", "--threads", "1"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout)
    assert set(r["modes"]) == {"bf16", "int8"} and r["llamacpp"] == []
    for rows in r["modes"].values():
        assert set(rows) == {"32", "64"}
        for row in rows.values():
            k = row["kvchat_s"]
            assert k["runs"] == 2 and 0 < k["min"] <= k["median"] <= k["max"] and "ratio_vs_llamacpp" not in row
    assert any(line.endswith("8/8") for line in run.stderr.splitlines() if line.startswith("[bench latency"))


@pytest.mark.parametrize("bad", [["--modes", "fp7"], ["--contexts", "8"], ["--contexts", "a,b"]])
def test_bad_options_are_one_line(bad):
    from kvchat.cli.terminal import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "latency", *bad])
