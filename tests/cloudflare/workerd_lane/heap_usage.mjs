// The memory each Worker's isolate holds under the lane, through workerd's V8 inspector (the lane
// started with "inspector_port" in its config):
//     node heap_usage.mjs PORT WORKER...   -> {WORKER: Runtime.getHeapUsage's result} on stdout
// usedSize / totalSize: the JS heap; backingStorageSize: the ArrayBuffers' backing stores, among
// them Pyodide's WebAssembly memory. docs/cloudflare.md, "Worker sizes and memory under workerd".
const [port, ...names] = process.argv.slice(2);
const out = {};
for (const name of names) {
  out[name] = await new Promise((resolve, reject) => {
    const ws = new WebSocket(`ws://127.0.0.1:${port}/core:user:${name}`);
    const timer = setTimeout(() => reject(new Error(`no answer from ${name}'s inspector in 20 s`)), 20000);
    ws.onopen = () => ws.send(JSON.stringify({ id: 1, method: "Runtime.getHeapUsage" }));
    ws.onmessage = (m) => {
      const d = JSON.parse(m.data);
      if (d.id !== 1) return;
      clearTimeout(timer);
      ws.close();
      d.error ? reject(new Error(`${name}: ${JSON.stringify(d.error)}`)) : resolve(d.result);
    };
    ws.onerror = (e) => reject(new Error(`${name}'s inspector: ${e.message ?? e}`));
  });
}
console.log(JSON.stringify(out));
