"""Checking a signed conditions record offline: `verify_conditions(signed, key)`.

The server signs each conditions record (`Sandbox.conditions()`) with HMAC-SHA256 over the record's
canonical JSON, under the key in `<state-dir>/conditions.key`. Whoever holds that key can check a
record stored with a result without asking the server (`client.verify` asks it). The canonical
JSON is what the server's `serde_json` writes for the record turned into a JSON value: object keys
sorted, no spaces, non-ASCII characters as they are, and numbers as parsed — integers as integers,
floats as serde_json prints them (`1.0`, `0.5`, `1e-7`, `1.5e+300`), which is where Python's `json.dumps`
differs (`1e-05` where serde_json writes `0.00001`, `1e-07` for `1e-7`). Start at
`verify_conditions`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
from decimal import Decimal
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from ._core import default_state_dir
from .models import SignedConditions

__all__ = ["verify_conditions", "canonical_json", "conditions_key", "SIGNATURE_PREFIX"]

#: How the server writes a signature: this prefix, then the lowercase hex of the HMAC.
SIGNATURE_PREFIX = "hmac-sha256:"

#: The key file in the server's state directory.
KEY_FILE = "conditions.key"


def verify_conditions(signed: Union[Mapping[str, Any], SignedConditions], key: bytes) -> bool:
    """True when `signed["signature"]` is the HMAC-SHA256, under `key`, of the canonical JSON of
    `signed["record"]`: the record is exactly as the server signed it. False for any other
    record, signature, or key, and for a record without a signature.

    `signed` is the answer of `Sandbox.conditions()` (a `SignedConditions`, checked through its
    `raw` answer) or that answer as a dict (as stored in a JSON file); `key` the bytes of the
    server's `<state-dir>/conditions.key` (see `conditions_key`). Compares in constant time.
    """
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"the key is the bytes of the server's {KEY_FILE}, not {type(key).__name__}")
    d = signed.raw if isinstance(signed, SignedConditions) else signed
    signature = d.get("signature")
    record = d.get("record")
    if not isinstance(signature, str) or not signature.startswith(SIGNATURE_PREFIX) or record is None:
        return False
    mac = hmac.new(bytes(key), canonical_json(record).encode("utf-8"), hashlib.sha256).hexdigest()
    given = signature[len(SIGNATURE_PREFIX) :].lower()
    return hmac.compare_digest(mac.encode("ascii"), given.encode("utf-8"))


def conditions_key(state_dir: Optional[Union[str, "os.PathLike[str]"]] = None) -> bytes:
    """The signing key of a server on this machine: the bytes of `<state-dir>/conditions.key`,
    the state directory found as the server finds it when not given (see `default_state_dir`)."""
    path = Path(state_dir) if state_dir is not None else default_state_dir()
    return (path / KEY_FILE).read_bytes()


def canonical_json(value: Any) -> str:
    """`value` as the server's `serde_json` writes it once turned into a JSON value: keys sorted,
    `,` and `:` with no spaces, strings escaped as `json.dumps(ensure_ascii=False)` does (the
    same escapes as serde_json), floats in Rust's shortest form."""
    parts: "list[str]" = []
    _write(value, parts)
    return "".join(parts)


def _write(value: Any, out: "list[str]") -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        out.append(str(int(value)))
    elif isinstance(value, float):
        out.append(rust_float(value))
    elif isinstance(value, str):
        out.append(json.dumps(value, ensure_ascii=False))
    elif isinstance(value, Mapping):
        out.append("{")
        for i, k in enumerate(sorted(value)):
            if not isinstance(k, str):
                raise TypeError(f"a JSON object key must be a string, not {type(k).__name__} ({k!r})")
            if i:
                out.append(",")
            out.append(json.dumps(k, ensure_ascii=False))
            out.append(":")
            _write(value[k], out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for i, v in enumerate(value):
            if i:
                out.append(",")
            _write(v, out)
        out.append("]")
    else:
        raise TypeError(f"{type(value).__name__} is not a JSON value ({value!r})")


def rust_float(f: float) -> str:
    """A float as serde_json writes an `f64` (serde_json 1.0.154, the server's, formats with the
    `zmij` crate): the shortest digits that read back as `f` — the digits Python's `repr` finds
    too — laid out as `1.0`, `0.00001234`, `1234000000000000.0`, `1e+16` or `1.234e-7`: plain
    from 1e-5 up to 1e16 (Python's repr: 1e-4 up to 1e16), and the exponent never padded
    (Python's: `1e-07`). serde_json writes a NaN or an infinity as `null`."""
    if not math.isfinite(f):
        return "null"
    sign = "-" if math.copysign(1.0, f) < 0 else ""
    if f == 0.0:
        return sign + "0.0"
    # Python's repr is the shortest round-tripping form too; only the layout differs.
    _, digit_tuple, exponent = Decimal(repr(abs(f))).as_tuple()
    coefficient = "".join(map(str, digit_tuple))
    digits = coefficient.rstrip("0")
    k = int(exponent) + len(coefficient) - len(digits)  # abs(f) == int(digits) * 10**k
    length = len(digits)
    kk = length + k  # 10**(kk-1) <= value < 10**kk
    if 0 <= k and kk <= 16:
        body = digits + "0" * k + ".0"
    elif 0 < kk <= 16:
        body = digits[:kk] + "." + digits[kk:]
    elif -5 < kk <= 0:
        body = "0." + "0" * -kk + digits
    else:
        mantissa = digits if length == 1 else f"{digits[0]}.{digits[1:]}"
        body = f"{mantissa}e{kk - 1:+d}"
    return sign + body
