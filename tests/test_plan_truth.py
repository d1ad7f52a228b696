"""The planner tells the truth about each memory: a GGUF stays packed on a GPU with the Triton kernels as on the CPU,
the GPU's free memory is judged against what lands on the GPU and the host's RAM against what stays on the host, and
every verdict (fits, tight, does not fit) comes out on a CPU and on a "cuda" device given as numbers."""
import pytest

from kvchat.engine.errors import ModelLoadError
from kvchat.engine.plan import fit
from kvchat.engine.plan.fit import FITS, TIGHT, TOO_BIG, DeviceMemory, plan_fit
from kvchat.engine.plan.presets import preset
from kvchat.engine.units import GIB, MIB

STORED = 80 * MIB           # a Q4-ish GGUF of SmolLM2-135M


@pytest.fixture(scope="module")
def mc():
    return preset("smollm2-135m")


def _free_for(need: int, share_left: float) -> int:
    """The free bytes that leave `share_left` of themselves once `need` (itself a function of them) is taken."""
    lo, hi = need, 1 << 50
    for _ in range(200):
        mid = (lo + hi) // 2
        left = mid - fit.margin_for(mid) - need
        lo, hi = (mid, hi) if left < share_left * mid else (lo, mid)
    return hi


@pytest.mark.parametrize("share, verdict", [(0.5, FITS), (0.05, TIGHT), (-0.01, TOO_BIG)])
def test_cpu_verdicts(mc, share, verdict):
    """On the CPU one memory holds all: the packed blocks and the reserve against available RAM."""
    free = _free_for(STORED, share)
    f = plan_fit(mc, STORED, "auto", DeviceMemory("cpu", free, free))
    assert (f.verdict, f.weight_bytes, f.need_bytes, f.host_need_bytes) == \
        (verdict, STORED, STORED + fit.margin_for(free), 0)


@pytest.mark.parametrize("share, verdict", [(0.5, FITS), (0.05, TIGHT), (-0.01, TOO_BIG)])
def test_packed_gguf_on_cuda_verdicts(mc, share, verdict):
    """A GGUF on a GPU with the Triton kernels lands as its blocks (the file's bytes), not as bf16: the verdict
    follows the GPU's free memory; plenty of host RAM changes nothing."""
    free = _free_for(STORED, share)
    f = plan_fit(mc, STORED, "auto", DeviceMemory("cuda", free, 64 * GIB, packs_gguf=True))
    assert f.weight_bytes == STORED < 2 * fit.parameter_count(mc)
    assert (f.verdict, f.need_bytes, f.free_bytes) == (verdict, STORED + fit.margin_for(free), free)


def test_dense_on_cuda_without_triton_plans_bf16(mc):
    """Without the Triton kernels the loader dequantizes to bf16 on the GPU: memory that holds the packed file
    does not hold that."""
    bf16 = 2 * fit.parameter_count(mc)
    free = _free_for(STORED, 0.05)
    assert bf16 + fit.margin_for(free) > free
    f = plan_fit(mc, STORED, "auto", DeviceMemory("cuda", free, 64 * GIB, packs_gguf=False))
    assert (f.verdict, f.weight_bytes) == (TOO_BIG, bf16)
    assert plan_fit(mc, STORED, "auto", DeviceMemory("cuda", free, 64 * GIB, packs_gguf=True)).verdict == TIGHT


def test_host_ram_judged_apart_from_the_gpu(mc):
    """A GPU with room but a host without room for the runtime and the matrix being read does not fit, and the
    refusal names the host's memory; tight host RAM makes the verdict tight."""
    staging = fit.staging_bytes(mc, STORED, "auto", "gguf", packed=True)
    assert 0 < staging < STORED
    gpu = DeviceMemory("cuda", 64 * GIB, fit.RUNTIME_BYTES, packs_gguf=True)
    f = plan_fit(mc, STORED, "auto", gpu)
    assert f.verdict == TOO_BIG and f.host_need_bytes == fit.margin_for(fit.RUNTIME_BYTES) + staging
    assert "of memory (RAM beside the GPU)" in f.message("m.gguf", "auto")
    host = _free_for(staging, 0.05)
    assert plan_fit(mc, STORED, "auto", DeviceMemory("cuda", 64 * GIB, host, True)).verdict == TIGHT


def test_check_fits_refuses_with_the_gpu_numbers(mc):
    """The loader's refusal plans with the same numbers, given here instead of read: GPU memory is named."""
    free = _free_for(STORED, -0.01)
    with pytest.raises(ModelLoadError, match=r"m\.gguf needs about \d+\.\d GiB of GPU memory"):
        fit.check_fits(mc, STORED, "auto", "cuda", "m.gguf", memory=DeviceMemory("cuda", free, 64 * GIB, True))
    fit.check_fits(mc, STORED, "auto", "cuda", "m.gguf", memory=DeviceMemory("cuda", 2 * free, 64 * GIB, True))


def test_device_memory_checks_its_numbers():
    with pytest.raises(ValueError, match="plan for cpu or cuda"):
        DeviceMemory("tpu", 1, 1)
    with pytest.raises(ValueError, match="never negative"):
        DeviceMemory("cuda", -1, 1)


def test_models_page_entry_plans_for_the_gpu(tmp_path, monkeypatch):
    """A scan given a GPU's numbers plans a GGUF packed there: an entry that would not fit as bf16 fits (tightly),
    with the device and its verdict; the same number as the CPU's RAM gives the CPU's verdict."""
    from kvchat.bench.gguf_writer import write_random_gguf
    from kvchat.engine.plan.estimate import model_facts_from
    from kvchat.engine.plan.library import scan
    for key in ("HF_HUB_CACHE", "HF_HOME", "OLLAMA_MODELS"):      # the peers' places: none but tmp_path's
        monkeypatch.delenv(key, raising=False)
    folder = tmp_path / "m"
    folder.mkdir()
    path = write_random_gguf(folder / "tiny.gguf", "tiny", "Q4_0", seed=3)
    facts = model_facts_from(path)
    bf16 = 2 * fit.parameter_count(facts.config)
    free = _free_for(facts.weight_bytes, 0.01)
    assert bf16 + fit.margin_for(free) > free >= facts.weight_bytes + fit.margin_for(free)
    (entry,) = scan([folder], memory=DeviceMemory("cuda", free, 64 * GIB, packs_gguf=True), home=tmp_path)
    assert (entry.device, entry.verdict) == ("cuda", TIGHT) and all(n for _, n in entry.fits)
    (dense,) = scan([folder], memory=DeviceMemory("cuda", free, 64 * GIB, packs_gguf=False), home=tmp_path)
    assert dense.verdict == TOO_BIG and all(n == 0 for _, n in dense.fits)
    (cpu,) = scan([folder], memory_bytes=free, home=tmp_path)
    assert (cpu.device, cpu.verdict) == ("cpu", TIGHT)
