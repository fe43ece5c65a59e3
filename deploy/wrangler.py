"""`knot deploy cloudflare`: one Python Worker per service, each a directory wrangler deploys.

    OUT/knot-<worker>/wrangler.json      name, main, compatibility date + python_workers, limits,
                                         R2 / KV / Durable Object bindings, migrations, services, vars
    OUT/knot-<worker>/src/entry.py       the main module: the role's WorkerEntrypoint and DO classes
    OUT/knot-<worker>/src/{common,services,deploy/cloudflare}/   the same code as the local host
    OUT/knot-<worker>/python_modules/    pure-Python dependencies copied from this environment
    OUT/knot-<worker>/pyproject.toml     what `pywrangler sync` adds for the runtime (numpy)
    OUT/README.md                        the real deploy steps
    OUT/secrets.env                      (the command) the Workers' secrets, mode 600, for `wrangler secret put`

Locked down: only the coordinator is published (workers.dev); every other Worker has
`workers_dev = false`, no preview URLs and no route, and is reached through bindings only. Every
internal call is signed (KNOT_INTERNAL_SECRET, a secret of every Worker), and the coordinator wants
an API key (KNOT_API_KEY, a secret) unless it is generated `public`. exposure_problems() is the check.

The topology is common.topology's ClusterLayout, the object docker-compose.yml is rendered from,
over the model's hyperparameters. Budgets are set for a 128 MB isolate (docs/cloudflare.md): the local
warden defaults of 1 GiB and 256 MiB would not fit.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from common.settings import default, lookup
from common.topology import ClusterLayout, Knob, replica_name
from deploy.r2_upload import RECORD as RECORD_NAME
from services.coordinator.subrequests import HopCost

REPO_ROOT = Path(__file__).resolve().parents[1]
PREFIX = "knot"
# python_workers with a date after 2026-09-08 implies python_workers_314: Pyodide 314, Python 3.14
# (docs/cloudflare.md; the offline tests run Pyodide 0.27.7, Python 3.12).
COMPATIBILITY_DATE = "2026-11-01"
COMPATIBILITY_FLAGS = ("python_workers",)
CPU_MS = 300_000  # the most a Worker or DO request may use (Paid plan); a long prefill needs it

ISOLATE_BYTES = 128 << 20  # per isolate and per Durable Object
# Pyodide, numpy, our modules, request buffers: what an isolate holds at rest under workerd, before
# any model data (docs/cloudflare.md, "Worker sizes and memory under workerd")
RUNTIME_RESERVE_BYTES = 72 << 20
BUDGETS = {  # MEMORY_BUDGET_BYTES per role, each + RUNTIME_RESERVE_BYTES <= ISOLATE_BYTES
    "station": 56 << 20,
    "shard": 56 << 20,
    "layer-warden": 48 << 20,
    "cobordism-warden": 32 << 20,
}
ROW_CACHE_BYTES = 4 << 20
KV_ID_PLACEHOLDER = "REPLACE_WITH_EMBED_CACHE_KV_NAMESPACE_ID"
INTERNAL_SECRET = "KNOT_INTERNAL_SECRET"  # every Worker: signs and verifies internal calls
API_KEY = "KNOT_API_KEY"  # the coordinator, unless public: the bearer token of the public API
SECRETS_FILE = "secrets.env"
# Subrequests per invocation by Workers plan (common/settings.py cites Cloudflare's limits page)
PLAN_SUBREQUESTS = {"paid": default("KNOT_CF_SUBREQUESTS_PAID", "deploy"),
                    "free": default("KNOT_CF_SUBREQUESTS_FREE", "deploy")}
PURE_PYTHON_DEPS = {"coordinator": ("jinja2", "markupsafe", "prometheus_client")}
RUNTIME_PACKAGES = ("common", "services")  # copied whole; of deploy/, only the adapter
ADAPTER = "deploy/cloudflare"

ENTRY = {
    "coordinator": ("from deploy.cloudflare.entry import worker_entrypoint\nfrom services import coordinator\n\n"
                    "Default = worker_entrypoint(coordinator.fetch, public=True)\n"),
    "station": ("from deploy.cloudflare.entry import forwarding_entrypoint, station_object\nfrom services import station\n\n"
                "Default = forwarding_entrypoint(\"STATION\", \"STATION_INSTANCE\")\n"
                "Station = station_object(station.fetch)\n"),
    "shard": ("from deploy.cloudflare.entry import worker_entrypoint\nfrom services import shard\n\n"
              "Default = worker_entrypoint(shard.fetch)\n"),
    "layer-warden": ("from deploy.cloudflare.entry import durable_object, worker_entrypoint\n"
                     "from services import layer_warden\n\nDefault = worker_entrypoint(layer_warden.fetch)\n"
                     "LayerWarden = durable_object(layer_warden.DURABLE_OBJECTS[\"LayerWarden\"])\n"),
    "cobordism-warden": ("from deploy.cloudflare.entry import durable_object, worker_entrypoint\n"
                         "from services import cobordism_warden\n\nDefault = worker_entrypoint(cobordism_warden.fetch)\n"
                         "CobordismWarden = durable_object(cobordism_warden.DURABLE_OBJECTS[\"CobordismWarden\"])\n"),
}


class DeployError(ValueError):
    pass


@dataclass
class Worker:
    name: str  # the Worker's name on Cloudflare, e.g. knot-station-0
    role: str  # a key of ENTRY
    vars: dict[str, str] = field(default_factory=dict)
    bindings: dict[str, str] = field(default_factory=dict)  # env name -> kind (deploy/cloudflare/workers_bindings.py)
    r2: dict[str, str] = field(default_factory=dict)  # binding -> bucket
    kv: dict[str, str] = field(default_factory=dict)  # binding -> namespace id
    durable_objects: list[dict[str, str]] = field(default_factory=list)
    services: dict[str, str] = field(default_factory=dict)  # binding -> Worker name
    classes: tuple[str, ...] = ()  # the DO classes this Worker defines (migrations)
    peers: dict[str, str] = field(default_factory=dict)  # service / DO binding -> the Worker its calls go to
    secrets: tuple[str, ...] = (INTERNAL_SECRET,)  # set with `wrangler secret put`, never in the config
    exposed: bool = False  # published on workers.dev (the coordinator only)

    def bind(self, name: str, kind: str) -> None:
        self.bindings[name] = kind

    def config(self) -> dict[str, Any]:
        """The wrangler.json of this Worker."""
        cfg: dict[str, Any] = {
            "name": self.name, "main": "src/entry.py", "compatibility_date": COMPATIBILITY_DATE,
            "compatibility_flags": list(COMPATIBILITY_FLAGS), "limits": {"cpu_ms": CPU_MS},
            "observability": {"enabled": True},
            # wrangler publishes a Worker on workers.dev unless told not to: only the coordinator is
            "workers_dev": self.exposed, "preview_urls": False,
        }
        if self.r2:
            cfg["r2_buckets"] = [{"binding": b, "bucket_name": n} for b, n in self.r2.items()]
        if self.kv:
            cfg["kv_namespaces"] = [{"binding": b, "id": i} for b, i in self.kv.items()]
        if self.durable_objects:
            cfg["durable_objects"] = {"bindings": self.durable_objects}
        if self.classes:
            cfg["migrations"] = [{"tag": "v1", "new_sqlite_classes": list(self.classes)}]
        if self.services:
            cfg["services"] = [{"binding": b, "service": s} for b, s in self.services.items()]
        names = sorted(self.vars)
        cfg["vars"] = {**self.vars, "KNOT_BINDINGS": json.dumps(self.bindings, separators=(",", ":")),
                       "KNOT_VARS": ",".join(names), "KNOT_SECRETS": ",".join(self.secrets),
                       "KNOT_PEERS": json.dumps(self.peers, separators=(",", ":")), "KNOT_SERVICE_NAME": self.name}
        return cfg


def station_instance(knot_key: str, layer_start: int, layer_end: int) -> str:
    """The name of a station's Durable Object: one per knot and layer range."""
    return f"{knot_key}|{layer_start}-{layer_end}"


ROLE_ENTRY = {"layer_warden": "layer-warden", "cobordism_warden": "cobordism-warden", "station": "station",
              "shard": "shard", "coordinator": "coordinator"}  # ClusterLayout role -> ENTRY key


def _text(v: Any) -> str:
    """A layout value as a wrangler var: a Knob takes its default (the settings table's, for compose)."""
    if not isinstance(v, Knob):
        return str(v)
    return v.default if v.default is not None else lookup(v.name).default_for("compose") or ""


def plan(n_layers: int, vocab_size: int, knot_key: str, n_stations: int = 2, n_shards: int = 8,
         bucket: str = "knots", kv_id: str = KV_ID_PLACEHOLDER, model_name: str = "",
         public: bool = False, subrequest_limit: int = PLAN_SUBREQUESTS["paid"], replicas: int = 1) -> list[Worker]:
    """The Workers of ClusterLayout (the object docker-compose.yml is rendered from), in its start
    order, which is also the deploy order (a Worker after those whose classes it binds). public: the
    coordinator serves without an API key (else KNOT_API_KEY is one of its secrets). replicas: Workers
    per station range and shard slice (a station replica's Durable Object is its own Worker's)."""
    layout = ClusterLayout.build({"block_count": n_layers, "vocab_size": vocab_size}, n_stations, n_shards,
                                 knot_key=knot_key, replicas=replicas)
    name = {s.name: f"{PREFIX}-{s.name}" for s in layout.services}
    instance = {replica_name(f"station-{s.index}", k): station_instance(knot_key, s.layer_start, s.layer_end)
                for s in layout.stations for k in range(replicas)}
    workers = []
    for svc in layout.services:
        if not svc.is_worker:
            continue  # the bucket and the KV store are R2 and Workers KV; the init job is the README's upload
        role = ROLE_ENTRY[svc.role]
        w = Worker(name[svc.name], role, {k: _text(v) for k, v in svc.vars.items()}, classes=svc.durable_objects,
                   exposed=svc.public)
        w.vars.pop(API_KEY, None)  # a secret, never a var (a var of the same name would clash with it)
        if svc.public and not public:
            w.secrets = (INTERNAL_SECRET, API_KEY)
        if svc.role == "coordinator":
            w.vars["SUBREQUEST_LIMIT"] = str(subrequest_limit)
            # a subrequest's I/O belongs to the request that made it: no call made for several
            w.vars["STEP_BATCH"] = "0"
        if "MEMORY_BUDGET_BYTES" in w.vars:
            w.vars["MEMORY_BUDGET_BYTES"] = str(BUDGETS[role])
        if "MODEL_NAME" in w.vars:
            w.vars["MODEL_NAME"] = model_name
        for b in svc.bindings:
            if b.kind == "bucket":
                w.r2[b.name] = bucket
                w.bind(b.name, "r2")
            elif b.kind == "kv":
                w.kv[b.name] = kv_id
                w.bind(b.name, "kv")
            elif b.kind == "durable_object":
                do = {"name": b.name, "class_name": b.resource}
                if b.service != svc.name:
                    do["script_name"] = name[b.service]
                w.durable_objects.append(do)
                w.bind(b.name, "do")
                w.peers[b.name] = name[b.service]
            elif b.service in instance:  # a station: its one named Durable Object (docs/cloudflare.md says why)
                w.durable_objects.append({"name": b.name, "class_name": "Station", "script_name": name[b.service]})
                w.bind(b.name, f"do-service:{instance[b.service]}")
                w.peers[b.name] = name[b.service]
            else:
                w.services[b.name] = name[b.service]
                w.bind(b.name, "service")
                w.peers[b.name] = name[b.service]
        if svc.role == "station":
            w.classes = ("Station",)
            w.vars["STATION_INSTANCE"] = instance[svc.name]
            w.durable_objects.insert(0, {"name": "STATION", "class_name": "Station"})
            w.bind("STATION", "do")
            w.peers["STATION"] = w.name
        workers.append(w)
    return workers


def longest_generations(n_stations: int, n_shards: int, plans: dict[str, int] = PLAN_SUBREQUESTS,
                        n_prompt: int = 16) -> dict[str, int]:
    """Per plan, the most tokens one generation gets within its subrequests (a prompt of n_prompt tokens,
    no drafts; each speculative trip that accepts drafts makes it longer)."""
    cost = HopCost(n_stations, n_shards)
    return {name: cost.longest(limit, n_prompt) for name, limit in plans.items()}


def exposure_problems(configs: dict[str, dict[str, Any]], public: bool = False) -> list[str]:
    """What would let the internet reach a Worker it should not, from each Worker's wrangler.json
    (name -> config): an internal Worker (any but the coordinator) that wrangler would publish
    (workers_dev not false, preview URLs, a route), a Worker whose calls are not signed (no
    KNOT_INTERNAL_SECRET among its secrets), and, unless public, a coordinator without an API key."""
    problems = []
    for name, cfg in configs.items():
        secrets = [s for s in str(cfg.get("vars", {}).get("KNOT_SECRETS", "")).split(",") if s]
        coordinator = name == f"{PREFIX}-coordinator"
        if INTERNAL_SECRET not in secrets:
            problems.append(f"{name}: {INTERNAL_SECRET} is not among its secrets: its calls are not signed or checked")
        for key in ("route", "routes"):
            if cfg.get(key):
                problems.append(f"{name}: has {key} {cfg[key]!r}")
        if cfg.get("preview_urls") is not False:
            problems.append(f"{name}: preview_urls is {cfg.get('preview_urls')!r}, not false")
        if not coordinator and cfg.get("workers_dev") is not False:
            problems.append(f"{name}: an internal Worker with workers_dev {cfg.get('workers_dev')!r} (wrangler "
                            f"publishes it on workers.dev unless it is false)")
        if coordinator and API_KEY not in secrets and not public:
            problems.append(f"{name}: no {API_KEY} among its secrets, and not generated --public")
    return problems


def _copy_package(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.pyd", "*.c", "*.h"),
                    dirs_exist_ok=True)


def vendor(package: str, dst_root: Path) -> Path:
    """Copy an installed pure-Python package (C speedups dropped: markupsafe falls back to _native)."""
    spec = find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DeployError(f"package {package!r} is not installed here; install it to vendor it into the bundle")
    src = Path(next(iter(spec.submodule_search_locations)))
    _copy_package(src, dst_root / package)
    return dst_root / package


def pyproject(worker: Worker) -> str:
    deps = ["numpy", *(p.replace("_", "-") for p in PURE_PYTHON_DEPS.get(worker.role, ()))]
    lines = ",\n".join(f'    "{d}"' for d in deps)
    return (f'[project]\nname = "{worker.name}"\nversion = "0.1.0"\nrequires-python = ">=3.12"\n'
            f"# `uv run pywrangler sync` installs these for the Workers runtime's Pyodide into python_modules/\n"
            f"dependencies = [\n{lines},\n]\n\n[dependency-groups]\ndev = [\"workers-py\", \"workers-runtime-sdk\"]\n")


def write(out: Path, workers: list[Worker], public: bool = False, upload_command: str | None = None) -> list[Path]:
    """Write every Worker's directory under `out`, and the README; returns the Worker directories.
    DeployError, before anything is written, when a Worker would be reachable from the internet
    (exposure_problems): an internal one published, or, unless public, a coordinator without an API key."""
    problems = exposure_problems({w.name: w.config() for w in workers}, public)
    if problems:
        raise DeployError("refusing to write a deployment the internet could reach:\n  " + "\n  ".join(problems)
                          + ("" if public else "\n(a coordinator without an API key needs --public)"))
    out.mkdir(parents=True, exist_ok=True)
    dirs = []
    for w in workers:
        d = out / w.name
        if d.exists():
            shutil.rmtree(d)
        src = d / "src"
        for pkg in RUNTIME_PACKAGES:
            _copy_package(REPO_ROOT / pkg, src / pkg)
        _copy_package(REPO_ROOT / ADAPTER, src / ADAPTER)
        (src / "deploy" / "__init__.py").write_text('"""Of deploy/, a Worker bundle holds only the adapter."""\n')
        (src / "entry.py").write_text(f'"""{w.name}: written by `knot deploy cloudflare` (deploy/wrangler.py)."""\n'
                                      + ENTRY[w.role])
        for package in PURE_PYTHON_DEPS.get(w.role, ()):
            vendor(package, d / "python_modules")
        (d / "pyproject.toml").write_text(pyproject(w))
        (d / "wrangler.json").write_text(json.dumps(w.config(), indent=2) + "\n")
        dirs.append(d)
    (out / "README.md").write_text(readme(workers) if upload_command is None else readme(workers, upload_command))
    return dirs


def _secret_puts(w: Worker) -> str:
    """The shell that sets a Worker's secrets from ../secrets.env (its values never on a command line)."""
    return " && ".join(f"grep '^{n}=' ../{SECRETS_FILE} | cut -d= -f2- | npx wrangler secret put {n}" for n in w.secrets)


def readme(workers: list[Worker], upload_command: str = "knot deploy cloudflare --out . --upload") -> str:
    bucket = workers[0].r2["KNOT_BUCKET"]
    knot_key = next(w.vars["KNOT_KEY"] for w in workers if "KNOT_KEY" in w.vars)
    coordinator = next(w for w in workers if w.exposed)
    deploys = "\n".join(f"(cd {w.name} && uv run pywrangler sync && npx wrangler deploy && {_secret_puts(w)})"
                         for w in workers)
    n_stations = sum(w.role == "station" for w in workers)
    n_shards = sum(w.role == "shard" for w in workers)
    limit = coordinator.vars.get("SUBREQUEST_LIMIT", "")
    if n_stations and n_shards:
        longest = longest_generations(n_stations, n_shards)
        cost = (f", and a generated token costs {HopCost(n_stations, n_shards).trip(1)} subrequests of the coordinator\n"
                f"({n_stations} stations, {n_shards} shards and one embedding call), so one generation runs at most\n"
                f"{longest['paid']} tokens on Paid and {longest['free']} on Free (SUBREQUEST_LIMIT={limit} here: a longer "
                f"one ends\nwith finish_reason \"length\" and limited_by \"subrequests\").")
    else:  # a partial set of Workers (no stations or no shards): no per-token cost to state
        cost = "."
    auth = f" -H \"Authorization: Bearer $(grep '^{API_KEY}=' {SECRETS_FILE} | cut -d= -f2-)\"" \
        if API_KEY in coordinator.secrets else ""
    return f"""# Deploying knot-cluster to Cloudflare Python Workers

Written by `knot deploy cloudflare`; docs/cloudflare.md in the repository explains every choice.
Needs a Workers **Paid** plan: each Worker and Durable Object request may use up to {CPU_MS // 1000} s of CPU
(`limits.cpu_ms`){cost}

Only `{coordinator.name}` is published (workers.dev); every other Worker has `workers_dev = false`, no
preview URLs and no route, and answers only calls signed with the cluster's secret. The secrets are in
`{SECRETS_FILE}` (mode 600, generated once and kept): `{INTERNAL_SECRET}` for every Worker{
    f", `{API_KEY}` for the coordinator (its clients send `Authorization: Bearer <key>`)" if auth else
    "; the coordinator was written --public: it serves without an API key"}.
A Worker whose secrets are not set yet refuses every request (503).

1. Log in: `npx wrangler login`.
2. Create the bucket and upload the knot through R2's S3 API (`wrangler r2 object put` refuses files
   over 300 MiB). Make an R2 API token with Object Read & Write on the bucket (dashboard: R2, Manage
   API tokens), then:

       npx wrangler r2 bucket create {bucket}
       export CLOUDFLARE_ACCOUNT_ID=<account id> R2_ACCESS_KEY_ID=<token's access key id>
       read -rs R2_SECRET_ACCESS_KEY && export R2_SECRET_ACCESS_KEY   # the token's secret, typed unseen
       {upload_command}

   It uploads {knot_key} in parts, each checked by its MD5 on arrival; interrupted, the same command
   continues from the parts already there. The object's ETag is printed and written to
   {RECORD_NAME} here.

3. Create the KV namespace that caches embedding rows, and put its id into
   knot-cobordism-warden/wrangler.json (`kv_namespaces[0].id`, now `{KV_ID_PLACEHOLDER}`):

       npx wrangler kv namespace create EMBED_CACHE

4. Deploy the Workers in this order (a Worker after those whose Durable Object classes it binds), each
   followed by its secrets (`wrangler secret put`, the values read from {SECRETS_FILE}).
   `pywrangler sync` (pip package `workers-py`) installs numpy for the runtime's Pyodide into
   python_modules/; jinja2, markupsafe and prometheus_client are vendored there already.

{deploys}

5. The coordinator's URL is printed by its deploy. Then, as locally:

       curl -s https://{coordinator.name}.<your-subdomain>.workers.dev/generate{auth} \\
            -H 'Content-Type: application/json' -d '{{"prompt": "def fibonacci(n):", "max_tokens": 16}}'
"""
