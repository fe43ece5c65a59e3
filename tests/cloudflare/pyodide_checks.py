"""Runs inside Pyodide (tests/cloudflare/node/harness.mjs imports it): the checks whose expected
values CPython computed (test_pyodide.py writes them), answered as plain dicts (JSON to the test).

Nothing here may import what Pyodide lacks: numpy and the bundle's code only.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import time

import numpy as np


def setup(paths: list[str]) -> dict:
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    t0 = time.perf_counter()
    import common.knot  # noqa: F401
    import common.models  # noqa: F401
    import common.quant  # noqa: F401
    return {"import_common_s": round(time.perf_counter() - t0, 3), "python": sys.version.split()[0],
            "numpy": np.__version__, "platform": sys.platform}


def check_dequant(npz_path: str) -> dict:
    """Every case's dequantization, bit-compared (uint32 patterns) with CPython's."""
    from common.quant import dequantize

    cases = np.load(npz_path)
    out = {}
    for name in sorted({k.split("/")[0] for k in cases.files}):
        raw, want, shape = cases[f"{name}/raw"], cases[f"{name}/want"], tuple(int(x) for x in cases[f"{name}/shape"])
        got = dequantize(raw, name.split("#")[0], shape)
        out[name] = {"elements": int(want.size),
                     "bit_exact": bool(got.dtype == np.float32 and got.shape == want.shape
                                       and np.array_equal(got.view(np.uint32), want.view(np.uint32)))}
    return out


def check_tokenizer(json_path: str) -> dict:
    """The pure-Python BPE (tokenizers cannot import here) against tokenizers' ids from CPython."""
    from common.tokenizer import Tokenizer

    with open(json_path, encoding="utf-8") as f:
        case = json.load(f)
    t0 = time.perf_counter()
    tok = Tokenizer(case["tokenizer"])
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    bad = [i for i, (text, ids) in enumerate(zip(case["texts"], case["ids"])) if tok.encode(text) != ids]
    return {"backend": tok.backend, "texts": len(case["texts"]), "mismatches": bad[:20], "n_mismatches": len(bad),
            "build_s": round(build_s, 3), "encode_s": round(time.perf_counter() - t0, 3),
            "tokens": sum(len(ids) for ids in case["ids"])}


def load_worker(name: str, path: str) -> str:
    """A Worker's generated main module under its own name (every bundle holds the same code)."""
    mod_name = "entry_" + name.replace("-", "_")
    spec = importlib.util.spec_from_file_location(mod_name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    return mod_name


def threads_fail() -> str:
    """What the issue measured: starting a thread raises under Pyodide."""
    import threading

    try:
        threading.Thread(target=lambda: None).start()
    except RuntimeError as e:
        return f"RuntimeError: {e}"
    return "started"


def signature(secret: str, method: str, path: str, body: str, to: str) -> str:
    """The X-Knot-Signature a Worker's binding puts on a call to Worker `to` (deploy/cloudflare/workers_bindings.py)."""
    from common.runtime import Request
    from deploy.cloudflare.workers_bindings import Signer, signing

    signed = Signer(secret, to).signed(Request(method, path, body=body.encode("utf-8")))
    return signed.headers[signing.SIGNATURE_HEADER]


def check_tool_calls(json_path: str) -> list:
    """services/coordinator/tools.py under Pyodide: each text's split_calls and, streamed in pieces of
    3 characters, ToolStream's content and calls ([content, [[name, arguments]...]], or TEXT)."""
    from services.coordinator.tools import ToolStream, parse_tools, split_calls

    with open(json_path, encoding="utf-8") as f:
        case = json.load(f)
    return [tool_call_outcome(text, parse_tools(case["body"]), split_calls, ToolStream) for text in case["texts"]]


TEXT = "kept as text"


def tool_call_outcome(text: str, tools, split_calls, stream_class) -> dict:
    """One text's calls whole and streamed, without the calls' random ids (CPython computes it too)."""
    def named(calls):
        return [[c["function"]["name"], c["function"]["arguments"]] for c in calls]

    split = split_calls(text, tools)
    s = stream_class(tools)
    sent = "".join(s.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, calls = s.finish_with("")
    whole = TEXT if split is None else [split[0], named(split[1])]  # (None would not cross to JS and back)
    return {"whole": whole, "streamed": [sent + rest, named(calls)]}
