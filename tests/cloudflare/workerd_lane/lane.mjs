// Serves the Workers that `knot deploy cloudflare` wrote under workerd, through miniflare (its local
// R2, KV and Durable Objects), offline. tests/cloudflare/test_workerd.py runs it:
//     node lane.mjs CONFIG.json   -> "READY {url, ...}" on stdout; serves until stdin closes
// A request reaches Worker NAME when it carries `MF-Original-URL: http://NAME/path` (each Worker's
// route is NAME/*); the first Worker (the coordinator) takes the rest.
import { readFileSync, readdirSync, existsSync, statSync } from "node:fs";
import { join, relative } from "node:path";

process.on("uncaughtException", (e) => { console.error(`lane: ${e?.stack ?? e}`); process.exit(1); });
process.on("unhandledRejection", (e) => { console.error(`lane: ${e?.stack ?? e}`); process.exit(1); });

const cfg = JSON.parse(readFileSync(process.argv[2], "utf8"));
process.env.MINIFLARE_WORKERD_PATH = cfg.workerd;  // a wrapper adding the Pyodide cache flags
const { Miniflare, Log, LogLevel } = await import(cfg.miniflare);
const ROOT = "/worker";  // module names are paths relative to it

function walk(dir) {
  const out = [];
  for (const name of readdirSync(dir).sort()) {
    const p = join(dir, name);
    if (statSync(p).isDirectory()) out.push(...walk(p)); else out.push(p);
  }
  return out;
}

// wrangler's layout of a Python Worker: src/ relative to the main module's directory, the vendored
// packages under python_modules/; .py files are Python modules, every other file a data module.
function modulesOf(dir) {
  const src = join(dir, "src");
  const mods = [{ type: "PythonModule", path: join(ROOT, "entry.py"), contents: readFileSync(join(src, "entry.py")) }];
  const add = (root, file, prefix) => {
    const name = prefix + relative(root, file);
    if (name === "entry.py" || name.includes("__pycache__") || name.includes(".dist-info/")) return;
    mods.push({ type: name.endsWith(".py") ? "PythonModule" : "Data", path: join(ROOT, name), contents: readFileSync(file) });
  };
  for (const f of walk(src)) add(src, f, "");
  for (const root of [join(dir, "python_modules"), ...(cfg.python_modules ?? [])]) {
    if (existsSync(root)) for (const f of walk(root)) add(root, f, "python_modules/");
  }
  return mods;
}

const config = (name) => JSON.parse(readFileSync(join(cfg.deploy, name, "wrangler.json"), "utf8"));
const sqliteClasses = (name) => new Set((config(name).migrations ?? []).flatMap((m) => m.new_sqlite_classes ?? []));

// One Worker from its wrangler.json, as `wrangler dev` reads it: the vars, the secrets it names
// (KNOT_SECRETS, as `wrangler secret put` would set them), R2, KV, Durable Objects (its own classes
// and other Workers'), service bindings. Only the compatibility date and flags are the lane's.
function workerOf(name) {
  const w = config(name);
  const durableObjects = {};
  for (const b of w.durable_objects?.bindings ?? []) {
    const script = b.script_name ?? name;
    durableObjects[b.name] = { className: b.class_name, scriptName: script, useSQLite: sqliteClasses(script).has(b.class_name) };
  }
  const secrets = {};
  for (const s of (w.vars?.KNOT_SECRETS ?? "").split(",").filter(Boolean)) {
    if (s in cfg.secrets) secrets[s] = cfg.secrets[s];
  }
  return {
    name,
    modules: modulesOf(join(cfg.deploy, name)),
    modulesRoot: ROOT,
    compatibilityDate: cfg.compatibility_date,
    compatibilityFlags: [...w.compatibility_flags, ...cfg.extra_flags],
    bindings: { ...(w.vars ?? {}), ...secrets },
    r2Buckets: Object.fromEntries((w.r2_buckets ?? []).map((b) => [b.binding, b.bucket_name])),
    kvNamespaces: Object.fromEntries((w.kv_namespaces ?? []).map((b) => [b.binding, b.id])),
    durableObjects,
    serviceBindings: Object.fromEntries((w.services ?? []).map((b) => [b.binding, b.service])),
    routes: [`${name}/*`],
  };
}

const names = readdirSync(cfg.deploy).filter((n) => existsSync(join(cfg.deploy, n, "wrangler.json"))).sort();
names.sort((a, b) => (b === cfg.entry) - (a === cfg.entry));
const t0 = performance.now();
const mf = new Miniflare({
  workers: names.map(workerOf),
  host: "127.0.0.1", port: 0, cf: false,
  r2Persist: false, kvPersist: false, durableObjectsPersist: false,
  log: new Log(LogLevel.WARN),
  // with "inspector_port": workerd's V8 inspector there, one target per Worker (heap_usage.mjs reads it)
  ...(cfg.inspector_port ? { inspectorPort: cfg.inspector_port } : {}),
  // workerd's log and the Workers' console (Python's print and logging) into the lane's log, which the
  // tests read: stdout stays the READY / KV protocol
  verbose: true, handleRuntimeStdio: (out, err) => { out.pipe(process.stderr); err.pipe(process.stderr); },
});
const url = await mf.ready;
const readyS = (performance.now() - t0) / 1000;
for (const [key, file] of Object.entries(cfg.objects ?? {})) {
  const bucket = await mf.getR2Bucket(cfg.bucket_binding, cfg.entry);
  await bucket.put(key, Uint8Array.from(readFileSync(file)));  // a whole ArrayBuffer: the proxy wants one
}
console.log("READY " + JSON.stringify({ url: url.href, ready_s: +readyS.toFixed(3), workers: names }));

// Until stdin closes: "KV <binding> <worker>" lists a KV namespace's keys (and their expirations).
let buffered = "";
process.stdin.setEncoding("utf8");
process.stdin.on("data", async (data) => {
  buffered += data;
  let nl;
  while ((nl = buffered.indexOf("\n")) >= 0) {
    const [op, binding, worker] = buffered.slice(0, nl).split(" ");
    buffered = buffered.slice(nl + 1);
    if (op === "KV") {
      const kv = await mf.getKVNamespace(binding, worker);
      const keys = [];
      let cursor;
      do {
        const page = await kv.list({ cursor });
        keys.push(...page.keys.map((k) => ({ name: k.name, expiration: k.expiration ?? null })));
        cursor = page.list_complete ? undefined : page.cursor;
      } while (cursor);
      console.log("KV " + JSON.stringify(keys));
    }
  }
});
process.stdin.on("end", async () => { await mf.dispose(); process.exit(0); });
