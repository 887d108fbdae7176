"""Engine-side rules that need no server: security defaults, the context ceiling, the budget, the split."""

from __future__ import annotations

import os
import stat

import pytest

from moetray.engine.api.security import (
    BindRefused,
    HostPolicy,
    api_key_from,
    bearer,
    check_bind,
    host_of,
    is_loopback,
    load_credentials,
)
from moetray.engine.budget import ContextCeiling, ContextTooLong, cpu_budget
from moetray.engine.cb import Sampling, kv_bytes_per_page, seeded_uniform
from moetray.engine.cb.sampling import _DrawProcessor, _Step
from moetray.engine.serve import parse_bytes
from moetray.policy.wire import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE_ENV, API_KEY_ENV

# --- security ------------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"])
def test_loopback_binds_need_no_key(host):
    assert is_loopback(host)
    check_bind(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.com"])
def test_a_non_loopback_bind_without_an_api_key_is_refused(host):
    """Opening /v1/* to the network must be a deliberate act (an API key), never a default."""
    with pytest.raises(BindRefused) as err:
        check_bind(host, None)
    assert err.value.kind == "non_loopback_without_key"
    check_bind(host, "a-key")  # with a key it is allowed


@pytest.mark.parametrize(
    ("header", "accepted"),
    [
        ("127.0.0.1:8765", True),
        ("localhost", True),
        ("[::1]:80", True),
        ("evil.example", False),
        ("evil.example:8765", False),
        ("127.0.0.1.evil.example", False),
        (None, False),
        ("", False),
        ("moetray.lan:9", True),
    ],
)
def test_host_policy_accepts_loopback_and_configured_names_only(header, accepted):
    assert HostPolicy(frozenset({"moetray.lan"})).accepts(header) is accepted


def test_host_parsing():
    assert host_of("[::1]:8080") == "::1"
    assert host_of("LocalHost:1") == "localhost"
    assert bearer("Bearer abc") == "abc" and bearer("bearer abc") == "abc"
    assert bearer("Basic abc") is None and bearer(None) is None and bearer("Bearer ") is None


def test_admin_token_comes_from_the_environment_first(tmp_path):
    creds = load_credentials(api_key=None, port=1, env={ADMIN_TOKEN_ENV: "from-env"}, token_dir=tmp_path)
    assert creds.admin_token == "from-env" and creds.token_file is None
    assert not list(tmp_path.iterdir())  # nothing written when the tray handed the token over


def test_admin_token_file_handover(tmp_path):
    f = tmp_path / "tok"
    f.write_text("from-file\n")
    creds = load_credentials(api_key=None, port=1, env={ADMIN_TOKEN_FILE_ENV: str(f)}, token_dir=tmp_path)
    assert creds.admin_token == "from-file"


def test_a_generated_admin_token_is_written_owner_only(tmp_path):
    creds = load_credentials(api_key=None, port=4242, env={}, token_dir=tmp_path)
    assert creds.token_file == tmp_path / f"engine-4242.{os.getpid()}.token"
    assert creds.token_file.read_text().strip() == creds.admin_token
    assert stat.S_IMODE(os.stat(creds.token_file).st_mode) == 0o600
    assert len(creds.admin_token) >= 32
    other = load_credentials(api_key=None, port=4242, env={}, token_dir=tmp_path)
    assert other.admin_token != creds.admin_token  # per launch


def test_api_key_flag_wins_over_the_environment(tmp_path):
    creds = load_credentials(api_key="flag", port=1, env={API_KEY_ENV: "env", ADMIN_TOKEN_ENV: "t"})
    assert creds.api_key == "flag"
    assert creds.api_ok("Bearer flag") and not creds.api_ok("Bearer env") and not creds.api_ok(None)
    open_engine = load_credentials(api_key=None, port=1, env={ADMIN_TOKEN_ENV: "t"})
    assert open_engine.api_ok(None)  # loopback without a key: /v1 is open
    assert not open_engine.admin_ok(None) and open_engine.admin_ok("Bearer t")


def test_the_api_key_comes_from_its_file_then_the_flag_then_the_environment(tmp_path):
    """``moetray serve`` reads the key so: a key kept off the command line (file, MOETRAY_API_KEY)
    guards /v1/* as the flag does."""
    key_file = tmp_path / "key"
    key_file.write_text("sk-file\n")
    env = {API_KEY_ENV: "sk-env"}
    assert api_key_from(flag="sk-flag", file=key_file, env=env) == "sk-file"
    assert api_key_from(flag="sk-flag", file=None, env=env) == "sk-flag"
    assert api_key_from(flag=None, file=None, env=env) == "sk-env"
    assert api_key_from(flag=None, file=None, env={}) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        api_key_from(flag=None, file=tmp_path / "empty", env=env)
    from_env = load_credentials(api_key=None, port=1, env={API_KEY_ENV: "sk-env", ADMIN_TOKEN_ENV: "t"})
    assert from_env.api_ok("Bearer sk-env") and not from_env.api_ok(None)
    check_bind("0.0.0.0", api_key_from(flag=None, file=None, env=env))  # a network bind with it


# --- context ceiling -------------------------------------------------------------------------------


def test_context_ceiling_clamps_max_tokens_and_refuses_with_the_exact_wording():
    ceiling = ContextCeiling.for_model(trained_context=100, kv_tokens=4096)
    assert ceiling.limit == 100
    assert ceiling.fit(10, 50) == 50
    assert ceiling.fit(90, 50) == 10
    assert ceiling.fit(99, None) == 1
    with pytest.raises(ContextTooLong) as err:
        ceiling.fit(100, 1)
    assert str(err.value) == "prompt is too long: 100 tokens > 99 maximum"
    assert err.value.kind == "context_length_exceeded"


def test_the_kv_pool_bounds_the_context_when_it_is_smaller_than_the_trained_one():
    """A request longer than the pool could never be scheduled: the ceiling says so up front."""
    assert ContextCeiling.for_model(trained_context=32768, kv_tokens=2048).limit == 2048
    assert ContextCeiling.for_model(trained_context=None, kv_tokens=512).limit == 512


# --- budget ---------------------------------------------------------------------------------------


def test_cpu_budget_is_labelled_host_ram_and_says_where_it_came_from():
    user = cpu_budget(123456789)
    assert user.kind == "cpu" and user.budget_bytes == 123456789
    assert "host RAM" in user.label and "user-set" in user.source
    default = cpu_budget(None, fraction=0.1)
    assert default.budget_bytes == int(default.total_bytes * 0.1)
    assert "10% of host RAM" in default.label


@pytest.mark.parametrize(
    ("text", "value"), [("1024", 1024), ("2G", 2 << 30), ("512MiB", 512 << 20), ("1.5k", 1536)]
)
def test_size_arguments(text, value):
    assert parse_bytes(text) == value


def test_kv_page_bytes_follow_the_model_geometry(tiny_moe):
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_moe("qwen3_moe", "per_expert"))
    # layers × (K and V) × kv heads × head dim × bytes × tokens per page
    expected = 2 * 2 * 2 * 16 * 4 * 16
    assert kv_bytes_per_page(config, page_size=16, dtype=torch.float32) == expected
    assert kv_bytes_per_page(config, page_size=16, dtype=torch.bfloat16) == expected // 2


# --- sampling draw --------------------------------------------------------------------------------


def test_the_draw_processor_picks_greedy_forced_and_seeded_tokens():
    import torch

    draw = _DrawProcessor(_Step())  # a step with no rows asking for log-probabilities
    scores = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 3)
    codes = torch.tensor([-1, -(2 + 2), int(0.999 * 2**31)], dtype=torch.int32)
    out = draw(scores, codes)
    assert out.argmax(dim=-1).tolist() == [1, 2, 3]  # greedy → mode; forced → id 2; u≈1 → last nonzero
    assert torch.isinf(out).sum().item() == 3 * 3  # every other logit masked
    assert 0.0 <= seeded_uniform(1, 0) < 1.0
    assert Sampling(temperature=0.0).greedy and not Sampling().greedy


def test_the_draw_processor_without_sampled_rows_takes_the_argmax_path():
    import torch

    draw = _DrawProcessor(_Step())  # a step with no rows asking for log-probabilities
    scores = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 0.0, 0.0]])
    out = draw(scores, torch.tensor([-1, -(3 + 2)], dtype=torch.int32))
    assert out.argmax(dim=-1).tolist() == [1, 3]
    assert torch.isinf(out).sum().item() == 2 * 3


# --- a stopped batch loop ------------------------------------------------------------------------


FREED_HEAP_PROBE = """
import json, psutil
from moetray.engine.cb.kv import return_freed_heap
proc = psutil.Process()
freed_blocks, kept = [], []
for _ in range(3200):  # 200 MiB of 64 KiB blocks, below the mmap threshold: on the heap
    freed_blocks.append(bytearray(b"x" * (64 << 10)))
    kept.append(bytearray(b"y" * 600))
del freed_blocks
held = proc.memory_info().rss
return_freed_heap()
print(json.dumps({"returned": held - proc.memory_info().rss, "kept": len(kept)}))
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_heap_held_between_live_blocks_is_handed_back():
    """What a stopped batch loop frees lies between blocks still in use, so glibc cannot shrink
    its heap from the top and keeps it resident; ``return_freed_heap`` (called by
    ``BatchRunner.stop``) hands it back. Measured in a fresh interpreter: after the API tests
    in the same process the RSS difference once came to 35 MiB (heap state left by earlier
    engines; cause not pinned down), so the probe owns its heap."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FREED_HEAP_PROBE], capture_output=True, text=True,
                          timeout=300, check=True)
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["returned"] >= 100 << 20 and probe["kept"] == 3200, probe


LOADED_HEAP_PROBE = """
import json, sys
from pathlib import Path
import psutil
from moetray.engine.cb.kv import return_freed_heap
from moetray.engine.core import EngineOptions
from moetray.engine.load import LoadState, load_model
opts = EngineOptions(model_dir=Path(sys.argv[1]), dtype="int8", moe_capacity=8, kv_tokens=512)
served, pools = load_model(opts, LoadState())
proc = psutil.Process()
held = proc.memory_info().rss
return_freed_heap()
print(json.dumps({"returned": held - proc.memory_info().rss}))
pools.close()
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_loading_hands_its_freed_heap_back(tiny_moe):
    """``load_model`` ends by handing back the heap loading freed (``--dtype int8``'s float32
    staging of every dense weight, the full-precision copies it replaced): a second trim right
    after it finds (almost) nothing. Without the trim this 8-layer model leaves 23 MiB resident
    (the demo's Q8_0 file as int8: 113 MiB). Measured in a fresh interpreter that owns its heap."""
    import json
    import subprocess
    import sys

    model = tiny_moe("qwen2_moe", hidden=512, num_layers=8)
    done = subprocess.run([sys.executable, "-c", LOADED_HEAP_PROBE, str(model)], capture_output=True,
                          text=True, timeout=600, check=True)
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["returned"] < 4 << 20, probe


ONEDNN_SHAPES_PROBE = """
import ctypes, json
import moetray.engine.serve  # the engine's process settings, as `moetray serve` starts
import torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
def in_use():
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd
torch.set_num_threads(1)
up, down = torch.randn(576, 192, dtype=torch.bfloat16), torch.randn(192, 576, dtype=torch.bfloat16)
rows = [torch.randn(m, 576, dtype=torch.bfloat16) for m in range(1, 257)]
before = in_use()
with torch.no_grad():
    for x in rows:  # one expert's products at every token count a 256-token chunk can route to it
        torch.mm(torch.mm(x, up), down)
print(json.dumps({"held": in_use() - before}))
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="mallinfo2 is glibc's")
def test_bfloat16_products_of_many_token_counts_leave_a_bounded_cache(tmp_path):
    """A prefill's expert products meet one matmul shape per routed token count, and oneDNN and
    ideep kept each compiled shape with its buffers (1,024 of each by default): 256 token counts
    through one expert held 281 MiB. The engine bounds both caches
    (``serve.ONEDNN_CACHED_SHAPES``): 35 MiB. Measured in a fresh interpreter without the user's
    own settings."""
    import json
    import os
    import subprocess
    import sys

    caches = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
    env = {k: v for k, v in os.environ.items() if k not in caches}
    done = subprocess.run([sys.executable, "-c", ONEDNN_SHAPES_PROBE], capture_output=True, text=True,
                          timeout=600, check=True, env=env, cwd=tmp_path)
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["held"] < 100 << 20, probe


# --- refusals ------------------------------------------------------------------------------------

def test_every_refusal_takes_its_kind_from_refused():
    """One shape for every refusal (``policy.refused.Refused``): a class that sets ``.kind`` by hand
    can skip the ``KINDS`` check and the ``fields`` the error bodies carry. (The static twin,
    tests/unit/test_refusal_kinds.py, also reads app/ and ui/ and class-level ``kind = …``.)"""
    import importlib
    import inspect
    import pkgutil

    import moetray.engine
    import moetray.policy
    from moetray.policy.refused import Refused

    own_kind = []
    for package in (moetray.policy, moetray.engine):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            module = importlib.import_module(info.name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ != module.__name__ or not issubclass(cls, BaseException) or cls is Refused:
                    continue
                name = f"{module.__name__}.{cls.__name__}"
                source = inspect.getsource(cls)
                if "self.kind =" in source or "self.kind:" in source or cls.__dict__.get("KINDS"):
                    own_kind.append((name, issubclass(cls, Refused), "self.kind" in source))
    assert own_kind  # the walk itself must find refusals
    assert [row for row in own_kind if not row[1] or row[2]] == []
