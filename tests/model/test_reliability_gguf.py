"""Corrupt and hostile GGUF files at `justapi serve` start: wrong sizes, absurd dimensions,
truncated tensor data, metadata that lies about the tensors, a chat template that tries to
escape its sandbox. Each fails with one readable error line and a non-zero exit, and leaves
no process behind; a template that only misbehaves for some messages renders in jinja2's
sandbox at request time: the request is refused, nothing escapes."""
from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys

import httpx
import pytest

from tools.harness import ServedPool
from workers.weights.synthetic import CHAT_TEMPLATE, SyntheticSpec, write_synthetic_gguf

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "base.gguf"
    write_synthetic_gguf(str(path), SyntheticSpec(context=256))
    return path.read_bytes()


def after_key(data: bytes, key: str) -> int:
    """Offset just past a GGUF string `key` (u64 length + bytes)."""
    raw = key.encode()
    return data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)


def patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def with_template(data: bytes, template: str) -> bytes:
    """The same file with another chat template of the same length (offsets unchanged)."""
    assert len(template) <= len(CHAT_TEMPLATE)
    padded = template + "{#" + "-" * (len(CHAT_TEMPLATE) - len(template) - 4) + "#}"
    return data.replace(CHAT_TEMPLATE.encode(), padded.encode(), 1)


def escape(marker: str) -> str:
    return "{{ cycler.__init__.__globals__.os.system('touch " + marker + "') }}"


def hostile_files(data: bytes, marker: str) -> dict[str, tuple[bytes, str]]:
    """name -> (file bytes, a phrase its error line must hold)."""
    value = after_key(data, "llama.embedding_length") + 4  # past the u32 value type
    q_dims = after_key(data, "blk.0.attn_q.weight") + 4  # past n_dims
    ffn_dims = after_key(data, "blk.1.ffn_down.weight") + 4
    return {
        "truncated": (data[:len(data) * 2 // 3], "truncated"),
        "header only": (data[:40], "corrupt or truncated"),
        "not gguf": (b"PK\x03\x04" + data[4:], "not a GGUF file"),
        "absurd tensor count": (patched(data, 8, "<Q", 1 << 60), "corrupt or truncated"),
        "absurd dimension": (patched(data, q_dims, "<Q", 1 << 40), "corrupt or truncated"),
        "absurd metadata": (patched(data, value, "<I", 1 << 30), "absurd"),
        "metadata lies": (patched(data, value, "<I", 128), "embedding_length 128"),
        "wrong tensor size": (patched(data, ffn_dims, "<Q", 96), "blk.1.ffn_down.weight"),
        "template escape": (with_template(data, escape(marker)), "chat template rejected"),
        "template broken": (with_template(data, "{% for x in %}"), "does not compile"),
    }


def short_marker() -> str:
    """A path short enough for the template to keep the file's layout; absent at first."""
    path = f"/tmp/jx{os.getpid()}"
    if os.path.exists(path):
        os.unlink(path)
    return path


def test_hostile_files_fail_at_start_with_one_line(base, tmp_path):
    marker = short_marker()
    for name, (content, phrase) in hostile_files(base, marker).items():
        path = tmp_path / f"{name.replace(' ', '_')}.gguf"
        path.write_bytes(content)
        result = subprocess.run([sys.executable, "-m", "justapi.cli", "serve", "--model",
                                 str(path), "--port", "0", "--ready-timeout-s", "60"],
                                capture_output=True, text=True, timeout=120)
        errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
        assert result.returncode != 0, (name, result.stderr)
        assert len(errors) == 1 and errors[0].startswith("justapi: error: "), (name, result.stderr)
        assert phrase in errors[0], (name, errors[0])
        assert "Traceback" not in result.stderr, (name, result.stderr)
    assert not os.path.exists(marker)


def test_a_template_that_escapes_only_for_some_messages_stays_in_the_sandbox(base, tmp_path):
    marker = short_marker()
    template = ("{% if messages[0].content == 'pwn' %}" + escape(marker) + "{% endif %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    path = tmp_path / "sly.gguf"
    path.write_bytes(with_template(base, template))
    with ServedPool("--model", str(path), "--pool-blocks", "64") as pool:
        url = f"{pool.base_url}/v1/chat/completions"
        fine = httpx.post(url, timeout=60, json={"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2})
        assert fine.status_code == 200, fine.text
        bad = httpx.post(url, timeout=60, json={"messages": [{"role": "user", "content": "pwn"}],
                                                "max_tokens": 2})
        assert bad.status_code == 400 and "chat template" in bad.json()["error"]["message"]
        assert httpx.post(url, timeout=60, json={"messages": [
            {"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200
        assert pool.stop(signal.SIGTERM) == 0
        assert pool.leftovers() == []
    assert not os.path.exists(marker)
