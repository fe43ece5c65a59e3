// Runs the project under Pyodide 0.27.7 in Node, offline: numpy from a local, hash-checked wheel,
// the workers-runtime-sdk's modules, and the Workers that `knot deploy cloudflare` wrote, wired by
// their wrangler.json over the doubles of doubles.mjs. tests/cloudflare/test_pyodide.py runs it:
//     node harness.mjs CONFIG.json     -> one line "RESULT {json}" on stdout
import { readFileSync, readdirSync, existsSync } from "node:fs";
import { join } from "node:path";
import { Cloud } from "./doubles.mjs";

// A failure prints its message (Pyodide's own stack lines are minified, thousands of columns wide).
process.on("uncaughtException", (e) => { console.error(`harness: ${e?.message ?? e}`); process.exit(1); });
process.on("unhandledRejection", (e) => { console.error(`harness: ${e?.message ?? e}`); process.exit(1); });

const cfg = JSON.parse(readFileSync(process.argv[2], "utf8"));
const { loadPyodide } = await import(join(cfg.pyodide, "pyodide.mjs"));
const result = { timings: {} };
const t = () => performance.now() / 1000;
let t0 = t();
const pyodide = await loadPyodide({ indexURL: cfg.pyodide + "/", stdout: (s) => console.error(s), stderr: (s) => console.error(s) });
result.timings.pyodide_start_s = +(t() - t0).toFixed(3);
t0 = t();
await pyodide.loadPackage(cfg.numpy, { messageCallback: () => {} });
result.timings.numpy_load_s = +(t() - t0).toFixed(3);

for (const [at, host] of Object.entries(cfg.mounts)) {
  pyodide.FS.mkdirTree(at);
  pyodide.mountNodeFS(at, host);
}
// workerd's internal modules the SDK imports (its entrypoint helper and the compat flags).
pyodide.registerJsModule("_pyodide_entrypoint_helper", {
  patchWaitUntil() {},  // workerd's; the adapter hands waitUntil JS Promises itself
  cloudflareWorkersModule: {}, cloudflareSocketsModule: {},
  doAnImport() { throw new Error("no imports in the test harness"); },
});
pyodide.registerJsModule("_cloudflare_compat_flags", {
  python_workflows_implicit_dependencies: false, python_request_headers_preserve_commas: false,
});

const py = (code) => pyodide.runPython(code);
const toJs = (proxy) => { const v = proxy.toJs({ dict_converter: Object.fromEntries }); proxy.destroy(); return v; };
py(`import sys; sys.path.insert(0, ${JSON.stringify(cfg.checks)})`);
const checks = pyodide.pyimport("pyodide_checks");
result.setup = toJs(checks.setup(cfg.python_path));
result.threads = checks.threads_fail();
result.tokenizers_importable = py("import importlib.util; importlib.util.find_spec('tokenizers') is not None");

if (cfg.dequant) {
  t0 = t();
  result.dequant = toJs(checks.check_dequant(cfg.dequant));
  result.timings.dequant_s = +(t() - t0).toFixed(3);
}
if (cfg.tokenizer) result.tokenizer = toJs(checks.check_tokenizer(cfg.tokenizer));
if (cfg.tool_calls) result.tool_calls = toJs(checks.check_tool_calls(cfg.tool_calls));

if (cfg.deploy) {
  const configs = {};
  for (const name of readdirSync(cfg.deploy).sort()) {
    const file = join(cfg.deploy, name, "wrangler.json");
    if (existsSync(file)) configs[name] = JSON.parse(readFileSync(file, "utf8"));
  }
  const cloud = new Cloud(pyodide, configs, cfg.secrets ?? {});
  for (const name of Object.keys(configs)) {
    const modName = checks.load_worker(name, `${cfg.deploy_mount}/${name}/src/entry.py`);
    cloud.modules.set(name, pyodide.pyimport(modName));
  }
  cloud.bucket(cfg.bucket).objects.set(cfg.knot_key, new Uint8Array(readFileSync(cfg.knot)));
  result.requests = [];
  for (const r of cfg.requests) {
    t0 = t();
    const init = { method: r.method ?? "POST", headers: { "Content-Type": "application/json" } };
    if (r.body !== undefined) init.body = JSON.stringify(r.body);
    if (r.signed) {  // as another Worker's binding signs it (deploy/cloudflare/workers_bindings.py), for r.worker
      init.headers["X-Knot-Signature"] = checks.signature(cfg.secrets.KNOT_INTERNAL_SECRET, init.method, r.path,
                                                          init.body ?? "", r.worker);
    }
    const res = await cloud.dispatch(r.worker, new Request(`https://${r.worker}${r.path}`, init));
    const out = { status: res.status, content_type: res.headers.get("content-type"), chunks: 0 };
    if (r.stream) {
      const reader = res.body.getReader();
      const parts = [];
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        out.chunks++;
        parts.push(Buffer.from(value).toString("utf8"));
      }
      out.text = parts.join("");
    } else {
      out.text = await res.text();
    }
    out.seconds = +(t() - t0).toFixed(3);
    console.error(`harness: ${r.worker}${r.path}: ${out.status} in ${out.seconds} s`);
    out.wait_until_failures = await cloud.drain();
    result.requests.push(out);
  }
  result.objects = [...cloud.objects.keys()];
  result.kv_rows = [...cloud.kvs.values()].reduce((n, kv) => n + kv.values.size, 0);
  result.r2_reads = cloud.bucket(cfg.bucket).reads;
  result.r2_ranges = cloud.bucket(cfg.bucket).ranges;
}
result.wasm_heap_bytes = pyodide._module.HEAP8.length;
console.log("RESULT " + JSON.stringify(result));
// Pyodide's event loop leaves cancelled asyncio timers (wait_for's 300 s timeouts) armed in Node.
process.exit(0);
