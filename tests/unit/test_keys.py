"""API keys and projects: the keys file's format and its errors, the lookup, and reloading that keeps the old keys
when the new file is bad."""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

import pytest

from gateway import deps, keys
from gateway.errors import APIError
from gateway.keys import KeyEntry, KeyRing, KeysFileError, parse_keys, read_keys
from gateway.store.tables import DEFAULT_PROJECT


def test_the_keys_file_format() -> None:
    text = ("# team keys\n\nsk-alpha-1 alpha\n  sk-alpha-2\talpha  \nsk-beta beta.prod_2\n# sk-old gamma\n"
            "sk-ops ops admin\n")
    assert parse_keys(text, "keys") == {"sk-alpha-1": KeyEntry("alpha"), "sk-alpha-2": KeyEntry("alpha"),
                                        "sk-beta": KeyEntry("beta.prod_2"), "sk-ops": KeyEntry("ops", admin=True)}


@pytest.mark.parametrize(("text", "line", "reason"), [
    ("sk-a alpha\nsk-b\n", 2, "expected 'KEY PROJECT' or 'KEY PROJECT admin', found 1 fields"),
    ("sk-a alpha root\n", 1, "the third field may only be 'admin'"),
    ("sk-a alpha # the alpha team\n", 1, "found 6"),
    ("sk-a alpha\n\nsk-b be/ta\n", 3, "a project name is"),
    ("sk-a alpha\nsk-a beta\n", 2, "the key of line 1 again"),
    ("sk-a " + "p" * 65 + "\n", 1, "a project name is"),
])
def test_a_malformed_line_is_named_and_the_key_is_not(text: str, line: int, reason: str) -> None:
    with pytest.raises(KeysFileError) as error:
        parse_keys(text, "/etc/ladle/keys")
    assert f"/etc/ladle/keys, line {line}: " in str(error.value) and reason in str(error.value)
    assert "sk-" not in str(error.value)


def test_a_file_without_keys_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# nobody yet\n")
    with pytest.raises(KeysFileError, match="no keys"):
        read_keys(None, path)
    with pytest.raises(KeysFileError, match="cannot read"):
        read_keys(None, tmp_path / "missing")


def test_api_key_is_a_key_of_the_default_project(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a alpha\n")
    assert read_keys("sk-main", path) == {"sk-a": KeyEntry("alpha"), "sk-main": KeyEntry(DEFAULT_PROJECT)}
    path.write_text("sk-main alpha\n")
    with pytest.raises(KeysFileError, match="another project"):
        read_keys("sk-main", path)


def test_lookup_and_the_default_project_without_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a alpha\nsk-b beta\n")
    ring = KeyRing("sk-main", path)
    assert ring.required
    assert [ring.project_of(k) for k in ("sk-a", "sk-b", "sk-main", "sk-", "sk-a ", "")] == [
        "alpha", "beta", DEFAULT_PROJECT, None, None, None]
    assert deps.authenticate("Bearer sk-b", ring) == "beta"
    assert deps.authenticate("bearer  sk-a ", ring) == "alpha"
    for header in ("", "Bearer sk-c", "Basic sk-a", "sk-a"):
        refusal = deps.authenticate(header, ring)
        assert isinstance(refusal, APIError) and refusal.status == 401 and refusal.code == "invalid_api_key"
    open_ring = KeyRing()
    assert not open_ring.required and deps.authenticate("", open_ring) == DEFAULT_PROJECT


def test_reload_takes_a_good_file_and_keeps_the_old_keys_on_a_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a alpha\n")
    ring = KeyRing(None, path)
    path.write_text("sk-a alpha\nsk-b beta\n")
    assert ring.reload() and ring.project_of("sk-b") == "beta"
    path.write_text("sk-a alpha\nsk-c\n")
    assert not ring.reload() and ring.project_of("sk-b") == "beta" and ring.project_of("sk-c") is None
    path.unlink()
    assert not ring.reload() and ring.project_of("sk-a") == "alpha"
    path.write_text("sk-c gamma\n")
    assert ring.reload() and ring.project_of("sk-a") is None and ring.project_of("sk-c") == "gamma"


def test_a_lookup_takes_one_step_whatever_the_number_of_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """100,000 keys: a lookup hashes the presented key once and finds its digest without walking the keys (the
    old lookup compared the digest with every key's, 100,000 compare_digest calls a request)."""
    path = tmp_path / "keys"
    path.write_text("".join(f"sk-{i:06d}-{'x' * 40} project{i % 50}\n" for i in range(100_000)))
    ring = KeyRing("sk-main", path)
    compares = hashes = 0
    real_compare, real_sha256 = keys.hmac.compare_digest, keys.hashlib.sha256

    def counting_compare(a: bytes, b: bytes) -> bool:
        nonlocal compares
        compares += 1
        return real_compare(a, b)

    def counting_sha256(data: bytes) -> object:
        nonlocal hashes
        hashes += 1
        return real_sha256(data)

    monkeypatch.setattr(keys.hmac, "compare_digest", counting_compare)
    monkeypatch.setattr(keys.hashlib, "sha256", counting_sha256)
    probes = [f"sk-{i:06d}-{'x' * 40}" for i in range(0, 100_000, 997)]
    assert [ring.project_of(k) for k in probes] == [f"project{int(k[3:9]) % 50}" for k in probes]
    assert ring.project_of("sk-000001-" + "x" * 39 + "y") is None and ring.project_of("sk-main") == DEFAULT_PROJECT
    assert compares == 0 and hashes == len(probes) + 2


def test_keys_are_held_only_as_digests() -> None:
    """The ring keeps no key itself, only SHA-256 digests: what a lookup's time can depend on is the presented
    key's digest, which says nothing about how close a guess came to a real key."""
    ring = KeyRing("sk-main")
    held = vars(ring)["_keys"]
    assert list(held) == [hashlib.sha256(b"sk-main").digest()] and ring.project_of("sk-main") == DEFAULT_PROJECT
    assert "authenticate(" in inspect.getsource(deps.request_project)
    assert "project_of(" in inspect.getsource(deps.authenticate)


def test_metrics_need_the_operators_key(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a alpha\nsk-ops default\n")

    def answer(ring: KeyRing, header: str) -> int:
        refusal = deps.authorize_metrics(header, ring)
        return 200 if refusal is None else refusal.status

    ring = KeyRing("sk-main", path)  # no metrics key: the default project's keys
    assert [answer(ring, h) for h in ("Bearer sk-main", "Bearer sk-ops", "Bearer sk-a", "Bearer sk-x", "")] == [
        200, 200, 403, 401, 401]
    ring = KeyRing("sk-main", path, metrics_key="sk-metrics")  # only the metrics key
    assert [answer(ring, h) for h in ("Bearer sk-metrics", "Bearer sk-main", "Bearer sk-a", "Bearer sk-x")] == [
        200, 403, 403, 401]
    assert deps.authenticate("Bearer sk-metrics", ring) != "default"  # it is no project's key
    assert answer(KeyRing(), "") == 200  # a gateway without keys: open, as every route
    assert [answer(KeyRing(metrics_key="sk-metrics"), h) for h in ("Bearer sk-metrics", "")] == [200, 401]


def test_admin_keys_alone_pass_the_operator_routes_once_one_exists(tmp_path: Path) -> None:
    """Flag a key `admin` and /metrics (and every operator route) answers only admin keys: a project key, the
    default project's included, gets 403; the --metrics-api-key still reads /metrics."""
    path = tmp_path / "keys"
    path.write_text("sk-a alpha\nsk-ops ops admin\n")

    def answer(ring: KeyRing, header: str) -> int:
        refusal = deps.authorize_metrics(header, ring)
        return 200 if refusal is None else refusal.status

    ring = KeyRing("sk-main", path)
    assert ring.has_admin and ring.is_admin("sk-ops") and not ring.is_admin("sk-main") and not ring.is_admin("sk-a")
    assert ring.project_of("sk-ops") == "ops"  # an admin key still acts for its own project elsewhere
    assert [answer(ring, h) for h in ("Bearer sk-ops", "Bearer sk-main", "Bearer sk-a", "Bearer sk-x")] == [
        200, 403, 403, 401]
    with_scraper = KeyRing("sk-main", path, metrics_key="sk-metrics")
    assert [answer(with_scraper, h) for h in ("Bearer sk-metrics", "Bearer sk-ops", "Bearer sk-main")] == [
        200, 200, 403]
    assert not with_scraper.is_admin("sk-metrics")  # it reads /metrics, nothing else
