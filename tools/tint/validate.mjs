// Validates WGSL compute pipelines with Dawn's Tint through dawn.node (npm's `webgpu`) on Dawn's null backend:
// WGSL validation and pipeline creation at WebGPU's default limits, no GPU or driver touched.
//   node tools/tint/validate.mjs pipelines.json     # [{name, wgsl, entry, constants}]
// Prints one JSON line {"name", "error"} per failing pipeline; exit code 1 if any failed, 2 if the check itself
// could not run.
import { readFileSync } from 'node:fs';
import { create } from 'webgpu';

const watchdog = setTimeout(() => { console.error('validate.mjs: timed out'); process.exit(2); }, 600_000);

// The pipelines of one device: each item's error scopes are pushed and popped synchronously around its create
// calls, so the items can be checked concurrently without mixing their errors.
function check(device, items) {
  return items.map((item) => {
    device.pushErrorScope('internal');
    device.pushErrorScope('validation');
    const module = device.createShaderModule({ code: item.wgsl });    // unlabelled: Dawn shares equal modules
    const info = module.getCompilationInfo();
    const pipeline = device.createComputePipelineAsync({
      label: item.name, layout: 'auto',
      compute: { module, entryPoint: item.entry, constants: item.constants ?? {} },
    }).then(() => null, (e) => e.message);
    const scopes = [device.popErrorScope(), device.popErrorScope()];
    return (async () => {
      const errors = (await info).messages.filter((m) => m.type === 'error')
        .map((m) => `${m.lineNum}:${m.linePos}: ${m.message}`);
      const scoped = (await Promise.all(scopes)).filter(Boolean).map((e) => e.message);
      const failed = await pipeline;
      if (!errors.length) errors.push(...scoped, ...(failed ? [failed] : []));   // else they only repeat it
      return errors.length ? { name: item.name, error: [...new Set(errors)].join('\n').trim() } : null;
    })();
  });
}

async function main() {
  const items = JSON.parse(readFileSync(process.argv[2], 'utf8'));
  const gpu = create(['backend=null']);
  const adapter = await gpu.requestAdapter();
  if (!adapter) throw new Error("Dawn's null backend gave no adapter");
  const requiredFeatures = ['shader-f16', 'subgroups'].filter((f) => adapter.features.has(f));
  const device = await adapter.requestDevice({ requiredFeatures });    // no requiredLimits: the defaults
  const failures = (await Promise.all(check(device, items))).filter(Boolean);
  for (const f of failures) console.log(JSON.stringify(f));
  device.destroy();
  return failures.length ? 1 : 0;
}

main().then(
  (rc) => { clearTimeout(watchdog); process.exit(rc); },
  (e) => { console.error('validate.mjs:', e?.stack ?? e); process.exit(2); });
