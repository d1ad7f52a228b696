"""kvchat installs one import name, `kvchat`, and shares an environment with whatever else is there: Hugging Face's
`kernels` package (which transformers imports while building a model) above all, whose name our kernels/ folder
took before it became kvchat.kernels."""
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel .` builds from this checkout (the locked setuptools, no build isolation: no network)."""
    out = tmp_path_factory.mktemp("wheel")
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    (path,) = out.glob("kvchat-*.whl")
    return path


def test_the_wheel_holds_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"kvchat", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, sorted(tops)
    top_level = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    if top_level:
        assert zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["kvchat"]
    # what the app needs at run time came along: the engine, the C kernels' sources, the style and the texts
    for needed in ("kvchat/__init__.py", "kvchat/engine/__init__.py", "kvchat/engine/runtime/session.py",
                   "kvchat/kernels/cpu_quant.c", "kvchat/kernels/cpu_common.h", "kvchat/resources/style.qss",
                   "kvchat/resources/i18n/kvchat_zh_CN.qm", "kvchat/cli/main.py", "kvchat/app/shell/main_window.py"):
        assert needed in names, needed
    # and nothing that is not the app's: the tests, the packaging scripts, the README pictures
    assert not [n for n in names if n.startswith(("kvchat/tests/", "kvchat/packaging/", "kvchat/docs/"))]
    assert not [n for n in names if "screenshot-" in n]
    entry = [n for n in names if n.endswith("entry_points.txt")]
    assert "kvchat = kvchat.cli.main:main" in zipfile.ZipFile(wheel).read(entry[0]).decode()


def test_an_installed_wheel_and_hf_kernels_share_one_process(wheel, tmp_path):
    """The wheel installed into a folder of its own (no editable mapping, no checkout on the path), run from an
    unrelated folder: Hugging Face's `kernels` imports as itself, transformers builds a tiny model and answers, and
    kvchat loads the same model and gives the same greedy next token."""
    site = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                          str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info")) in (["kvchat"], ["bin", "kvchat"])
    code = textwrap.dedent("""
        import sys, torch
        import kernels as hf_kernels
        import kvchat
        assert kvchat.__file__.startswith(sys.argv[1]), kvchat.__file__
        assert "site-packages" in hf_kernels.__file__ and hasattr(hf_kernels, "get_kernel"), hf_kernels.__file__
        from tiny_models import tiny_model_dir
        from transformers import AutoModelForCausalLM
        folder = tiny_model_dir(sys.argv[2], arch="qwen2", hidden=64, layers=2, heads=4, kv_heads=2)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ids = [5, 9, 23, 42, 7]
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0, -1]
        assert "kernels" in sys.modules and sys.modules["kernels"] is hf_kernels
        from kvchat.engine import Engine, EngineConfig
        engine = Engine.load(EngineConfig(model=folder, weights="dense"))
        got = engine.new_session().append(ids)[-1]
        assert int(got.argmax()) == int(want.argmax()), (int(got.argmax()), int(want.argmax()))
        assert torch.allclose(got.float(), want, atol=1e-2), (got.float() - want).abs().max()
        import kvchat.kernels
        assert kvchat.kernels.__name__ == "kvchat.kernels" and sys.modules["kernels"] is hf_kernels
        print("OK", kvchat.__file__, hf_kernels.__file__)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(HERE)])
    work = tmp_path / "elsewhere"
    work.mkdir()
    run = subprocess.run([sys.executable, "-c", code, str(site), str(tmp_path / "tiny")], cwd=work, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.startswith("OK")


def test_the_checkout_root_is_not_an_import_path():
    """The suite runs with the repository root off sys.path, so none of its folders shadows a package of the same
    name; kvchat's modules are reached only through `kvchat`."""
    assert all(Path(p or os.curdir).resolve() != ROOT for p in sys.path)
    import kernels as hf_kernels
    import kvchat.kernels
    assert hf_kernels is not kvchat.kernels and Path(kvchat.kernels.__file__).parent == ROOT / "kernels"
    for name in ("app", "cli", "engine", "bench", "resources"):
        module = sys.modules.get(name)
        assert module is None or not str(getattr(module, "__file__", "") or "").startswith(str(ROOT)), name


def test_no_module_imports_a_bare_top_level_name():
    """Every import of kvchat's own code names kvchat: a bare `import engine` would work only from the checkout."""
    import re
    names = "(app|cli|engine|kernels|bench|resources)"
    bare = re.compile(rf"^\s*(?:from\s+{names}(?:\.\w+)*\s+import\b|import\s+{names}(?:\.\w+)*\s*(?:as\b|#|$))", re.M)
    offenders = []
    for folder in ("app", "cli", "engine", "kernels", "bench", "resources", "tests", "packaging"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            for m in bare.finditer(text):
                if path.name == "test_namespace.py" and m.group(0).strip() == "import kernels as":
                    continue        # Hugging Face's kernels, imported on purpose here
                offenders.append(f"{path.relative_to(ROOT)}: {m.group(0).strip()}")
    assert offenders == [], offenders


def test_run_from_the_checkout_kvchat_takes_its_root_off_the_path():
    """`python -m kvchat.cli.main` (or -c) in the repository root puts the root on sys.path, where kernels/ would
    pass for Hugging Face's `kernels`; importing kvchat takes it off, so transformers finds the real one."""
    code = ("import sys, kvchat, transformers.integrations.hub_kernels, kernels; "
            "assert 'site-packages' in kernels.__file__, kernels.__file__; "
            "import kvchat.kernels; assert kvchat.kernels is not kernels; print('OK')")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "OK", run.stderr[-3000:]
    version = subprocess.run([sys.executable, "-m", "kvchat.cli.main", "--version"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("kvchat "), version.stderr[-2000:]
