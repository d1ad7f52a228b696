"""--prefill auto on an AVX2, AVX-512 or AMX CPU (Xeon, Zen 4, Ice Lake, AVX2 EPYC): decided by measuring the fp32
GEMM, bf16's where the CPU multiplies bf16, and the int8 rows once, kept per machine so every later start (the
engine's, the one-shot path's, doctor's) makes the same choice, and said with its numbers."""
import json
from types import SimpleNamespace

import pytest

from kvchat.engine.runtime import engine as engine_mod
from kvchat.kernels import cpu_lib

ZEN4 = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx512bf16"}
PACKED = SimpleNamespace(device="cpu", weights="gguf")      # what choose_prefill reads of a model


@pytest.fixture
def zen4(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_lib, "cpu_features", lambda: set(ZEN4))
    calls = []
    real = engine_mod.measure_prefill

    def counted(*a, **k):
        calls.append(1)
        return real(rows=16, n=256, k=256, tries=3)
    monkeypatch.setattr(engine_mod, "measure_prefill", counted)
    return calls, tmp_path


def test_measured_once_then_kept(zen4):
    calls, folder = zen4
    assert cpu_lib.auto_prefill() == ("fp32", "no AMX: not measured yet (the engine measures it on its first load)")
    first = engine_mod.choose_prefill("auto", PACKED)
    assert first[0] in ("fp32", "bf16", "int8") and first[1].startswith("measured here: bf16 ")
    assert calls == [1]
    assert engine_mod.choose_prefill("auto", PACKED) == first == cpu_lib.auto_prefill()
    assert calls == [1]                                     # kept: the next start decides the same
    assert engine_mod.choose_prefill("fp32", PACKED) == ("fp32", "asked for")


def test_a_record_measured_before_int8_is_measured_again(zen4):
    calls, folder = zen4
    path = folder / "kernels" / "prefill-choice.json"
    path.parent.mkdir(parents=True)
    key = cpu_lib._machine_key().replace(f"{cpu_lib.PREFILL_RECORD}|", "", 1)      # the first records' key
    path.write_text(json.dumps({"key": key, "choice": "bf16", "why": "measured here: the bf16 GEMM ran 3x"}))
    assert cpu_lib.prefill_record() is None
    engine_mod.choose_prefill("auto", PACKED)
    assert calls == [1] and "int8" in cpu_lib.prefill_record()[1] or not _gemm8()


def test_a_record_holds_for_the_kernels_build_it_was_measured_with(zen4, monkeypatch):
    """The avx512 build's measurement (its int8 rows the fastest) does not stand for the avx2 build, which has no int8
    rows: forced (KVCHAT_CPU_VARIANT) or where AVX-512 would not build, the machine is measured again, and doctor and
    the one-shot path say "not measured yet" until it is, not int8."""
    calls, _ = zen4
    monkeypatch.setattr(cpu_lib, "current_variant", lambda: "avx512")
    cpu_lib.save_prefill_record("int8", "measured here: int8 rows 3.3x the exact fp32 GEMM")
    assert cpu_lib.auto_prefill() == ("int8", "measured here: int8 rows 3.3x the exact fp32 GEMM")
    monkeypatch.setattr(cpu_lib, "current_variant", lambda: "avx2")
    assert cpu_lib.prefill_record() is None and cpu_lib.auto_prefill()[0] == "fp32"
    monkeypatch.setattr(cpu_lib, "current_variant", lambda: "avx512")
    assert cpu_lib.prefill_record()[0] == "int8" and calls == []


def _gemm8() -> bool:
    from kvchat.kernels import cpu_quant
    return cpu_quant.gemm8_available()


@pytest.mark.parametrize("record", ["{not json", json.dumps({"key": "another machine", "choice": "bf16", "why": "x"}),
                                    json.dumps({"key": None, "choice": "fp64", "why": "x"})])
def test_a_damaged_or_foreign_record_is_measured_again(zen4, record):
    calls, folder = zen4
    path = folder / "kernels" / "prefill-choice.json"
    path.parent.mkdir(parents=True)
    path.write_text(record.replace('"key": null', json.dumps({"key": cpu_lib._machine_key()})[1:-1]))
    assert cpu_lib.prefill_record() is None
    engine_mod.choose_prefill("auto", PACKED)
    assert calls == [1] and cpu_lib.prefill_record() is not None


def test_amx_is_measured_too_and_takes_bf16_until_then(monkeypatch, tmp_path):
    """An AMX Xeon weighs AMX's bf16 GEMM against the int8 rows like any other CPU (the int8 rows read short prompts
    2-3x faster there, with no slab); before its first measurement it says bf16. A CPU without AVX2 is never
    measured: fp32."""
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_lib, "cpu_features", lambda: ZEN4 | {"amx_bf16"})
    assert cpu_lib.prefill_measured_here()
    assert cpu_lib.auto_prefill() == ("bf16", "the CPU's AMX multiplies bf16 (not measured yet: the engine measures "
                                              "it on its first load)")
    monkeypatch.setattr(engine_mod, "measure_prefill", lambda *a, **k: ("int8", "measured here: a stand-in"))
    assert engine_mod.choose_prefill("auto", PACKED) == ("int8", "measured here: a stand-in") == cpu_lib.auto_prefill()
    monkeypatch.setattr(engine_mod, "measure_prefill", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setattr(cpu_lib, "cpu_features", lambda: {"sse4_2"})
    assert not cpu_lib.prefill_measured_here()
    assert engine_mod.choose_prefill("auto", PACKED) == ("fp32", "no AMX, AVX-512 or AVX2 on this CPU")


def test_avx2_weighs_the_int8_rows_against_fp32_without_bf16(monkeypatch, tmp_path):
    """An AVX2 CPU (AMD EPYC before Zen 4) has the int8 rows (maddubs) but no bf16 multiply: measured between fp32
    and int8 only, kept, and said."""
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_lib, "cpu_features", lambda: {"avx", "avx2", "fma", "f16c"})
    real = engine_mod.measure_prefill
    calls = []
    monkeypatch.setattr(engine_mod, "measure_prefill",
                        lambda *a, **k: calls.append(1) or real(rows=16, n=256, k=256, tries=3))
    choice, why = engine_mod.choose_prefill("auto", PACKED)
    assert calls == [1] and "bf16" not in why and ("int8 " in why) == _gemm8() and choice in ("fp32", "int8")
    assert cpu_lib.auto_prefill() == (choice, why) and engine_mod.choose_prefill("auto", PACKED) == (choice, why)
    assert calls == [1]


def test_the_measurement_itself_times_every_path(monkeypatch):
    monkeypatch.setattr(cpu_lib, "cpu_features", lambda: set(ZEN4))
    choice, why = engine_mod.measure_prefill(rows=16, n=256, k=256, tries=3)
    assert choice in ("fp32", "bf16", "int8") and why.startswith("measured here: bf16 ") and "the exact fp32 GEMM" in why
    assert ("int8 " in why) == _gemm8()


def test_int8_where_the_build_cannot_is_the_exact_gemm_said(monkeypatch):
    from kvchat.kernels import cpu_quant
    monkeypatch.setattr(cpu_quant, "gemm8_available", lambda: False)
    choice, why = engine_mod.choose_prefill("int8", PACKED)
    assert choice == "fp32" and "AVX2 or AVX-512" in why
