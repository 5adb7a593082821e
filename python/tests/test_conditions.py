"""Conditions records: `Sandbox.conditions()` and `client.verify` on the wire (a fake server), and
`verify_conditions` checking a record offline, against canonical JSON that serde_json wrote."""

from __future__ import annotations

import copy
import hashlib
import hmac
import json
from typing import Any, Callable, Dict, List

import httpx
import pytest
from conftest import Server

import sandman
from sandman import SignedConditions, canonical_json, conditions_key, verify_conditions
from sandman.conditions import rust_float

#: A conditions record as the server sends it (fields in struct order), with floats in each of
#: serde_json's layouts and strings that need escaping.
RECORD_TEXT = r"""{"sandbox":"sb-7f3a","job":"eval-run","provider":"process","server_version":"0.1.0",
 "recorded_ms":1764451200123,
 "asked":{"image":"host","resources":{"cpu":"500m","memory":"256Mi","pids":256},"profile":"eval","network":"none"},
 "applied":{"image":"host","cpu":0.5,"memory":268435456,"swap":0,"pids":256,"network":"none","timezone":"UTC",
   "locale":"C.UTF-8","details":{"cgroup":"/sys/fs/cgroup/sandman/sb-7f3a","cpu_max":"50000 100000","weight":1.0,
   "tiny":1e-7,"small":0.00001,"big":2.5e20,"huge":1e16,"note":"ünïcode ✓ \"quoted\" \\ back\u0001\t/",
   "nested":{"b":[1.0,2,-0.0],"a":null,"c":true}}},
 "observed":{"daemon_version":"0.1.0","kernel":"6.8.0","cpu_model":"AMD EPYC","cpus_available":2,
   "cgroup_cpu_limit":0.5,"cgroup_memory_limit":268435456,"cgroup_swap_limit":0,"cgroup_pids_limit":256,
   "rlimit_nofile":1048576,"network_interfaces":["lo"],"timezone":"UTC","locale":"C.UTF-8","hostname":"sb-7f3a",
   "pid1":true},
 "mismatches":[]}"""

#: What `serde_json::to_string(&serde_json::from_str::<Value>(RECORD_TEXT)?)` printed (serde_json
#: 1.0.154, the workspace's): the bytes the server signs.
SERDE_CANONICAL = (
    r'{"applied":{"cpu":0.5,"details":{"big":2.5e+20,"cgroup":"/sys/fs/cgroup/sandman/sb-7f3a",'
    r'"cpu_max":"50000 100000","huge":1e+16,"nested":{"a":null,"b":[1.0,2,-0.0],"c":true},'
    r'"note":"ünïcode ✓ \"quoted\" \\ back\u0001\t/","small":0.00001,"tiny":1e-7,"weight":1.0},'
    r'"image":"host","locale":"C.UTF-8","memory":268435456,"network":"none","pids":256,"swap":0,'
    r'"timezone":"UTC"},"asked":{"image":"host","network":"none","profile":"eval",'
    r'"resources":{"cpu":"500m","memory":"256Mi","pids":256}},"job":"eval-run","mismatches":[],'
    r'"observed":{"cgroup_cpu_limit":0.5,"cgroup_memory_limit":268435456,"cgroup_pids_limit":256,'
    r'"cgroup_swap_limit":0,"cpu_model":"AMD EPYC","cpus_available":2,"daemon_version":"0.1.0",'
    r'"hostname":"sb-7f3a","kernel":"6.8.0","locale":"C.UTF-8","network_interfaces":["lo"],"pid1":true,'
    r'"rlimit_nofile":1048576,"timezone":"UTC"},"provider":"process","recorded_ms":1764451200123,'
    r'"sandbox":"sb-7f3a","server_version":"0.1.0"}'
)

KEY = bytes(range(32))
#: HMAC-SHA256 of SERDE_CANONICAL under KEY, and the first 16 hex digits of SHA-256(KEY).
SIGNATURE = "hmac-sha256:a275ba8b7bfc720cccc565af7e6bdf481429f41e896e007215a746c0a85cfdcf"
KEY_ID = "630dcd2966c43366"


def signed() -> Dict[str, Any]:
    """The answer of `GET /v1/sandboxes/sb-7f3a/conditions`, parsed from its text."""
    return {"record": json.loads(RECORD_TEXT), "signature": SIGNATURE, "key_id": KEY_ID}


# ---- canonical JSON ----


def test_the_canonical_form_of_the_literal_serde_json_wrote() -> None:
    record = json.loads('{"a":1,"b":1.0,"c":[0.5,"x"],"d":{"z":null,"y":true}}')
    assert canonical_json(record) == '{"a":1,"b":1.0,"c":[0.5,"x"],"d":{"y":true,"z":null}}'


def test_a_whole_record_canonicalizes_byte_for_byte_as_serde_json_does() -> None:
    assert canonical_json(json.loads(RECORD_TEXT)) == SERDE_CANONICAL
    # The fixture is what it says: HMAC-SHA256 of those bytes, by the standard library.
    mac = hmac.new(KEY, SERDE_CANONICAL.encode("utf-8"), hashlib.sha256).hexdigest()
    assert SIGNATURE == f"hmac-sha256:{mac}" and KEY_ID == hashlib.sha256(KEY).hexdigest()[:16]


#: (Python's repr, what serde_json 1.0.154 writes for that f64), printed by serde_json: where the
#: two agree and every place they differ (the plain range, and the exponent's form).
SERDE_FLOATS = [
    ("1.0", "1.0"),
    ("0.5", "0.5"),
    ("-0.0", "-0.0"),
    ("0.1", "0.1"),
    ("100.0", "100.0"),
    ("0.6666666666666666", "0.6666666666666666"),
    ("1000000000000000.0", "1000000000000000.0"),
    ("9007199254740992.0", "9007199254740992.0"),
    ("1234567890123456.8", "1234567890123456.8"),
    ("1e+16", "1e+16"),
    ("1.2345678901234568e+16", "1.2345678901234568e+16"),
    ("1.5e+300", "1.5e+300"),
    ("1.7976931348623157e+308", "1.7976931348623157e+308"),
    ("0.0001", "0.0001"),
    ("0.000123", "0.000123"),
    ("1e-05", "0.00001"),
    ("2.5e-05", "0.000025"),
    ("1.234e-05", "0.00001234"),
    ("5e-05", "0.00005"),
    ("1e-06", "1e-6"),
    ("2.5e-07", "2.5e-7"),
    ("-3.25e-10", "-3.25e-10"),
    ("1.1e-100", "1.1e-100"),
    ("5e-324", "5e-324"),
]


@pytest.mark.parametrize("python, serde", SERDE_FLOATS)
def test_floats_are_written_as_serde_json_writes_them(python: str, serde: str) -> None:
    f = float(python)
    assert repr(f) == python
    assert rust_float(f) == serde
    assert float(serde) == f  # the same number


def test_ints_stay_ints_and_bools_are_not_numbers() -> None:
    assert canonical_json([1, 1.0, True, False, None, 2**64 - 1]) == "[1,1.0,true,false,null,18446744073709551615]"
    assert canonical_json({"é": "ü", "a": "\x7f"}) == '{"a":"\x7f","é":"ü"}'
    with pytest.raises(TypeError, match="not a JSON value"):
        canonical_json({"a": object()})


# ---- verify_conditions, offline ----


def test_an_intact_record_verifies_as_a_dict_and_as_the_parsed_answer() -> None:
    assert verify_conditions(signed(), KEY)
    # As stored with a result and read back: through text, indented, keys in any order.
    stored = json.loads(json.dumps(signed(), indent=2, sort_keys=True))
    assert verify_conditions(stored, KEY)
    assert verify_conditions(SignedConditions.from_dict(signed()), KEY)
    # An upper-case hex signature is the same signature.
    upper = dict(signed(), signature=SIGNATURE.upper().replace("HMAC-SHA256:", "hmac-sha256:"))
    assert verify_conditions(upper, KEY)


def _tampered() -> List[Callable[[Dict[str, Any]], None]]:
    def memory(d: Dict[str, Any]) -> None:
        d["record"]["applied"]["memory"] = 1 << 30

    def float_to_int(d: Dict[str, Any]) -> None:
        d["record"]["applied"]["details"]["weight"] = 1  # 1.0 -> 1: another record to serde_json

    def mismatch_dropped(d: Dict[str, Any]) -> None:
        d["record"]["mismatches"] = []
        d["record"]["observed"]["cgroup_pids_limit"] = 255

    def field_added(d: Dict[str, Any]) -> None:
        d["record"]["note"] = "looks fine"

    def field_removed(d: Dict[str, Any]) -> None:
        del d["record"]["observed"]["rlimit_nofile"]

    def string_changed(d: Dict[str, Any]) -> None:
        d["record"]["applied"]["details"]["note"] = d["record"]["applied"]["details"]["note"].replace("✓", "x")

    def signature_flipped(d: Dict[str, Any]) -> None:
        sig = d["signature"]
        d["signature"] = sig[:-1] + ("0" if sig[-1] != "0" else "1")

    def other_scheme(d: Dict[str, Any]) -> None:
        d["signature"] = d["signature"].replace("hmac-sha256:", "md5:")

    def no_signature(d: Dict[str, Any]) -> None:
        del d["signature"]

    def no_record(d: Dict[str, Any]) -> None:
        del d["record"]

    return [
        memory,
        float_to_int,
        mismatch_dropped,
        field_added,
        field_removed,
        string_changed,
        signature_flipped,
        other_scheme,
        no_signature,
        no_record,
    ]


@pytest.mark.parametrize("tamper", _tampered(), ids=lambda f: f.__name__)
def test_a_tampered_record_is_rejected(tamper: Callable[[Dict[str, Any]], None]) -> None:
    d = copy.deepcopy(signed())
    tamper(d)
    assert not verify_conditions(d, KEY)


def test_another_key_rejects_and_a_text_key_is_refused() -> None:
    assert not verify_conditions(signed(), bytes(32))
    with pytest.raises(TypeError, match="conditions.key"):
        verify_conditions(signed(), KEY.hex())  # type: ignore[arg-type]


def test_the_key_is_read_from_the_state_directory(tmp_path: Any, monkeypatch: Any) -> None:
    (tmp_path / "conditions.key").write_bytes(KEY)
    assert conditions_key(tmp_path) == KEY
    monkeypatch.setenv("SANDMAN_STATE_DIR", str(tmp_path))
    assert verify_conditions(signed(), conditions_key())


# ---- the calls ----


async def test_conditions_is_parsed_into_typed_fields_and_keeps_the_raw_answer(mock_api: Any) -> None:
    seen: List[httpx.Request] = []
    answer = signed()
    answer["record"]["mismatches"] = [{"field": "pids", "applied": "256", "observed": "255"}]

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=answer)

    async with mock_api(handler) as c:
        got = await c.sandbox("sb-7f3a").conditions()
        again = await c.conditions("sb-7f3a")
    assert [(r.method, r.url.path) for r in seen] == [("GET", "/v1/sandboxes/sb-7f3a/conditions")] * 2
    assert got == again and got.to_dict() == answer
    assert (got.signature, got.key_id) == (SIGNATURE, KEY_ID)
    rec = got.record
    assert (rec.sandbox, rec.job, rec.provider, rec.server_version, rec.recorded_ms) == (
        "sb-7f3a", "eval-run", "process", "0.1.0", 1764451200123,
    )
    assert (rec.asked.image, rec.asked.profile, rec.asked.network) == ("host", "eval", "none")
    assert rec.asked.resources == {"cpu": "500m", "memory": "256Mi", "pids": 256}
    a = rec.applied
    assert (a.image, a.cpu, a.memory, a.swap, a.pids) == ("host", 0.5, 268435456, 0, 256)
    assert (a.network, a.timezone, a.locale, a.details["cpu_max"]) == ("none", "UTC", "C.UTF-8", "50000 100000")
    o = rec.observed
    assert (o.daemon_version, o.kernel, o.cpu_model, o.cpus_available, o.hostname, o.pid1) == (
        "0.1.0", "6.8.0", "AMD EPYC", 2, "sb-7f3a", True,
    )
    assert (o.cgroup_cpu_limit, o.cgroup_memory_limit, o.cgroup_swap_limit, o.cgroup_pids_limit) == (
        0.5, 268435456, 0, 256,
    )
    assert (o.rlimit_as, o.rlimit_fsize, o.rlimit_nofile) == (None, None, 1048576)
    assert (o.network_interfaces, o.timezone, o.locale) == (["lo"], "UTC", "C.UTF-8")
    assert [(m.field, m.applied, m.observed) for m in rec.mismatches] == [("pids", "256", "255")]
    assert not got.matches


async def test_verify_sends_the_record_as_answered_and_reads_the_verdict(mock_api: Any) -> None:
    bodies: List[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/conditions"):
            return httpx.Response(200, json=signed())
        assert (request.method, request.url.path) == ("POST", "/v1/verify")
        body = json.loads(request.content)
        bodies.append(body)
        if body["record"]["applied"]["memory"] != 268435456:
            return httpx.Response(200, json={"valid": False, "problem": "it was changed after signing"})
        return httpx.Response(200, json={"valid": True})

    async with mock_api(handler) as c:
        got = await c.conditions("sb-7f3a")
        ok = await c.verify(got)
        tampered = got.to_dict()
        tampered["record"] = dict(tampered["record"], applied=dict(tampered["record"]["applied"], memory=1))
        bad = await c.verify(tampered)
    # What was sent is what was answered, floats and all (1.0 stays 1.0 on the wire).
    assert bodies[0] == signed()
    assert canonical_json(bodies[0]["record"]) == SERDE_CANONICAL
    assert (ok.valid, ok.problem) == (True, None)
    assert (bad.valid, bad.problem) == (False, "it was changed after signing")


async def test_a_sandbox_failed_for_mismatched_conditions_names_its_reason(mock_api: Any) -> None:
    assert "conditions_mismatch" in sandman.REASONS

    def handler(request: httpx.Request) -> httpx.Response:
        error = {"code": "unavailable", "message": "sandbox `sb-1` failed (conditions_mismatch): pids: 256 != 255",
                 "reason": "conditions_mismatch"}
        return httpx.Response(503, json={"error": error})

    async with mock_api(handler) as c:
        with pytest.raises(sandman.Unavailable) as e:
            await c.create("host", profile="eval", resources={"cpu": 1, "memory": "256Mi"})
    assert e.value.reason == "conditions_mismatch" and "pids" in e.value.message


# ---- a real server ----


async def test_a_real_eval_sandbox_has_a_record_that_verifies_offline_and_with_the_server(
    api: Any, server: Server
) -> None:
    async with await api.create(
        "host", profile="eval", network="none", resources={"cpu": 0.5, "memory": "256Mi"}, lease=30
    ) as sb:
        got = await sb.conditions()
    rec = got.record
    assert (rec.sandbox, rec.provider, rec.asked.profile, rec.asked.network) == (sb.id, "process", "eval", "none")
    assert (rec.applied.cpu, rec.applied.memory, rec.applied.network) == (0.5, 256 << 20, "none")
    assert (rec.observed.cgroup_cpu_limit, rec.observed.timezone, rec.observed.locale) == (0.5, "UTC", "C.UTF-8")
    assert got.matches and got.signature.startswith("hmac-sha256:")
    key = conditions_key(server.state)
    assert got.key_id == hashlib.sha256(key).hexdigest()[:16]
    assert verify_conditions(got, key)
    stored = json.loads(json.dumps(got.to_dict()))
    assert verify_conditions(stored, key)
    assert (await api.verify(got)) == sandman.Verification(True, None)
    stored["record"]["applied"]["memory"] = 512 << 20
    assert not verify_conditions(stored, key)
    verdict = await api.verify(stored)
    assert not verdict.valid and verdict.problem
