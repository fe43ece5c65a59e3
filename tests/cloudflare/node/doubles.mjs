// workerd-shaped doubles of a Python Worker's bindings, for Pyodide under Node (harness.mjs).
// Node 22's own Request, Response, Headers and ReadableStream stand in for workerd's.
// Shapes and pitfalls as measured (see tests/cloudflare/workerd.py, the CPython twin):
//  - R2Bucket.get(key, {range: {offset, length}}) clamps a length past the end; offset == size
//    throws "Unspecified error (0)", offset > size throws error 10039;
//  - R2 / KV put take strings, ArrayBuffers or typed arrays, not a Python object (a PyProxy);
//  - KV put with expirationTtl < 60 throws;
//  - a service binding's fetch(input, init) refuses a PyProxy init (a Python dict) with TypeError;
//  - ctx.waitUntil(p) resolves p later: a borrowed PyProxy is destroyed by then.
import { createHash } from "node:crypto";

// workerd's IdentityTransformStream (deploy/cloudflare/convert.py pipes a response's stream through
// one): Node has the standard TransformStream, whose default transform is the identity.
globalThis.IdentityTransformStream ??= class IdentityTransformStream extends TransformStream {};

function bytesOf(value, what, isPyProxy) {
  if (value === null || value === undefined) return new Uint8Array(0);
  if (typeof value === "string") return new TextEncoder().encode(value);
  if (value instanceof ArrayBuffer) return new Uint8Array(value.slice(0));
  if (ArrayBuffer.isView(value)) return new Uint8Array(value.buffer.slice(value.byteOffset, value.byteOffset + value.byteLength));
  const kind = isPyProxy(value) ? "a Python object (PyProxy)" : typeof value;
  throw new TypeError(`${what}: parameter 2 is not of type 'ReadableStream or ArrayBuffer or ArrayBufferView or string or Blob' (${kind})`);
}

export class R2Object {
  constructor(key, data) {
    this.key = key;
    this.size = data.byteLength;
    this.etag = createHash("md5").update(data).digest("hex");
    this.httpEtag = `"${this.etag}"`;
    this.version = this.etag.slice(0, 16);
  }
}

export class GetResult extends R2Object {
  constructor(key, data, offset, length) {
    super(key, data);
    this.range = { offset, length };
    this._body = data.slice(offset, offset + length);
    this.bodyUsed = false;
  }
  async arrayBuffer() {
    if (this.bodyUsed) throw new TypeError("Body has already been used");
    this.bodyUsed = true;
    return this._body.buffer.slice(this._body.byteOffset, this._body.byteOffset + this._body.byteLength);
  }
}

export class R2Bucket {
  constructor(isPyProxy) { this.objects = new Map(); this.isPyProxy = isPyProxy; this.reads = 0; this.ranges = []; }
  async head(key) {
    const d = this.objects.get(key);
    return d ? new R2Object(key, d) : null;
  }
  async get(key, options) {
    const d = this.objects.get(key);
    if (!d) return null;
    const range = options?.range;  // a Map (to_js without Object.fromEntries) has no .range
    this.reads++;
    if (range === undefined) return new GetResult(key, d, 0, d.byteLength);
    const offset = range.offset, length = range.length ?? d.byteLength - offset;
    this.ranges.push([offset, length]);
    if (offset === d.byteLength) throw new Error("get: Unspecified error (0)");
    if (offset > d.byteLength) throw new Error("get: The requested range is not satisfiable (10039)");
    return new GetResult(key, d, offset, Math.min(length, d.byteLength - offset));
  }
  async put(key, value) {
    const d = bytesOf(value, "Failed to execute 'put' on 'R2Bucket'", this.isPyProxy);
    this.objects.set(key, d);
    return new R2Object(key, d);
  }
  async list(options) {
    const prefix = options?.prefix ?? "", limit = options?.limit ?? 1000;
    const keys = [...this.objects.keys()].filter((k) => k.startsWith(prefix)).sort().slice(0, limit);
    return { objects: keys.map((k) => new R2Object(k, this.objects.get(k))), truncated: false };
  }
}

export class KvNamespace {
  constructor(isPyProxy) { this.values = new Map(); this.ttls = new Map(); this.isPyProxy = isPyProxy; }
  async get(key, options) {
    const type = typeof options === "string" ? options : options?.type ?? "text";
    const d = this.values.get(key);
    if (d === undefined) return null;
    if (type === "arrayBuffer") return d.buffer.slice(d.byteOffset, d.byteOffset + d.byteLength);
    return new TextDecoder().decode(d);
  }
  async put(key, value, options) {
    const d = bytesOf(value, "Failed to execute 'put' on 'KvNamespace'", this.isPyProxy);
    const ttl = options?.expirationTtl;
    if (ttl !== undefined && ttl < 60) {
      throw new Error(`KV PUT failed: 400 Invalid expiration_ttl of ${ttl}. Expiration TTL must be at least 60.`);
    }
    this.values.set(key, d);
    if (ttl !== undefined) this.ttls.set(key, ttl);
  }
  async delete(key) { this.values.delete(key); }
}

export class ExecutionContext {
  constructor() { this.promises = []; }
  waitUntil(p) { this.promises.push(Promise.resolve(p)); }  // a thenable's .then runs in a later job
  passThroughOnException() {}
}

export class DurableObjectId {
  constructor(classKey, name) {
    this.hex = createHash("sha256").update(`${classKey}\0${name}`).digest("hex");
    this.name = name;
  }
  toString() { return this.hex; }
  equals(other) { return other instanceof DurableObjectId && other.hex === this.hex; }
}

export class DurableObjectState extends ExecutionContext {
  constructor(id) {
    super();
    // Inside the object the id carries no name; the adapter learns it from the stub's header.
    this.id = { toString: () => id.hex, equals: (o) => id.equals(o) };
    this.storage = {};
  }
}

export class Fetcher {
  constructor(cloud, worker) { this.cloud = cloud; this.worker = worker; }
  fetch(input, init) {
    if (init !== undefined && this.cloud.isPyProxy(init)) {
      throw new TypeError("Failed to execute 'fetch' on 'Fetcher': parameter 2 is not of type 'RequestInit'");
    }
    return this.cloud.dispatch(this.worker, new Request(input, init));
  }
}

export class DurableObject extends Fetcher {  // a stub: workerd calls its class DurableObject
  constructor(namespace, id) { super(namespace.cloud, namespace.worker); this.namespace = namespace; this.id = id; }
  fetch(input, init) {
    if (init !== undefined && this.cloud.isPyProxy(init)) throw new TypeError("parameter 2 is not of type 'RequestInit'");
    return this.namespace.deliver(this.id, new Request(input, init));
  }
}

export class DurableObjectNamespace {
  constructor(cloud, worker, className) { this.cloud = cloud; this.worker = worker; this.className = className; }
  idFromName(name) { return new DurableObjectId(`${this.worker}/${this.className}`, name); }
  get(id) { return new DurableObject(this, id); }
  async deliver(id, request) {
    const key = `${this.worker}/${this.className}/${id.hex}`;
    let inst = this.cloud.objects.get(key);
    if (!inst) {
      const cls = this.cloud.module(this.worker)[this.className];
      const state = new DurableObjectState(id);
      inst = { obj: cls(state, this.cloud.env(this.worker)), state };
      this.cloud.objects.set(key, inst);
    }
    const res = await inst.obj.fetch(request);
    this.cloud.pending.push(...inst.state.promises.splice(0));
    return this.cloud.unwrap(res);
  }
}

// The Workers of a `knot deploy cloudflare` output, wired by their wrangler.json.
export class Cloud {
  constructor(pyodide, configs, secrets = {}) {
    this.pyodide = pyodide;
    this.configs = configs;  // worker name -> wrangler.json object
    this.secrets = secrets;  // name -> value: what `wrangler secret put` gives every Worker's env
    this.buckets = new Map();
    this.kvs = new Map();
    this.objects = new Map();
    this.pending = [];
    this.envs = new Map();
    this.modules = new Map();
    this.isPyProxy = (x) => x instanceof pyodide.ffi.PyProxy;
  }
  bucket(name) {
    if (!this.buckets.has(name)) this.buckets.set(name, new R2Bucket(this.isPyProxy));
    return this.buckets.get(name);
  }
  module(worker) { return this.modules.get(worker); }
  env(worker) {
    if (!this.envs.has(worker)) {
      const cfg = this.configs[worker];
      const env = { ...(cfg.vars ?? {}), ...this.secrets };
      for (const b of cfg.r2_buckets ?? []) env[b.binding] = this.bucket(b.bucket_name);
      for (const b of cfg.kv_namespaces ?? []) {
        if (!this.kvs.has(b.id)) this.kvs.set(b.id, new KvNamespace(this.isPyProxy));
        env[b.binding] = this.kvs.get(b.id);
      }
      for (const b of cfg.durable_objects?.bindings ?? []) {
        env[b.name] = new DurableObjectNamespace(this, b.script_name ?? worker, b.class_name);
      }
      for (const b of cfg.services ?? []) env[b.binding] = new Fetcher(this, b.service);
      this.envs.set(worker, env);
    }
    return this.envs.get(worker);
  }
  unwrap(res) {  // workerd's entrypoint wrapper: res?.js_object ?? res
    const js = res?.js_object ?? res;
    if (res && this.isPyProxy(res)) res.destroy();
    return js;
  }
  async dispatch(worker, request) {  // per request: a new entrypoint instance and a new ctx
    const ctx = new ExecutionContext();
    const inst = this.module(worker).Default(ctx, this.env(worker));
    try {
      return this.unwrap(await inst.fetch(request));
    } finally {
      this.pending.push(...ctx.promises);
      inst.destroy();
    }
  }
  async drain() {
    const failures = [];
    while (this.pending.length) {
      for (const p of this.pending.splice(0)) {
        try { await p; } catch (e) { failures.push(String(e?.message ?? e)); }
      }
    }
    return failures;
  }
}
