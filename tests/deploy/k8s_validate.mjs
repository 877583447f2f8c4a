// Offline schema check of Kubernetes manifests: every object against the Kubernetes 1.27 schema
// of its kind (kubernetes-models), no cluster needed. Kinds it has no schema for (custom
// resources) are listed as skipped. It does not flag unknown fields.
//   node tests/deploy/k8s_validate.mjs deploy/k8s/            (NODE_PATH: the packages' node_modules)
// A directory stands for its *.yaml / *.yml files, as `kubectl apply -f DIR` reads them.
import { readFileSync, readdirSync, statSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { pathToFileURL } from "node:url";

// ESM ignores NODE_PATH: resolve the packages from it by hand.
const require = createRequire(path.join(process.env.NODE_PATH ?? process.cwd(), "noop.js"));
const resolve = (name) => require.resolve(name);
const { parseAllDocuments } = await import(resolve("yaml"));

// Custom resources with schemas of their own (deploy/k8s/monitoring/). Their packages export
// ESM only, which require.resolve cannot see: the file is found from the package's directory.
const crdPackages = {
  "monitoring.coreos.com": "@kubernetes-models/prometheus-operator",
  "keda.sh": "@kubernetes-models/keda",
};
const crdModule = (pkg, group, version, kind) => pathToFileURL(
  path.join(path.dirname(resolve(`${pkg}/package.json`)), group, version, `${kind}.js`)).href;

let bad = 0;
let checked = 0;
const files = process.argv.slice(2).flatMap((arg) => (statSync(arg).isDirectory()
  ? readdirSync(arg).filter((f) => /\.ya?ml$/.test(f)).sort().map((f) => path.join(arg, f))
  : [arg]));
for (const file of files) {
  for (const doc of parseAllDocuments(readFileSync(file, "utf8"))) {
    if (doc.errors.length) { console.error(`${file}: YAML: ${doc.errors[0].message}`); bad++; continue; }
    const obj = doc.toJS();
    if (!obj) continue;
    const name = `${file}: ${obj.kind}/${obj.metadata?.name}`;
    if (!obj.apiVersion || !obj.kind) { console.error(`${name}: no apiVersion or kind`); bad++; continue; }
    const [group, version] = obj.apiVersion.includes("/") ? obj.apiVersion.split("/") : [null, obj.apiVersion];
    const module = crdPackages[group] ? crdModule(crdPackages[group], group, version, obj.kind)
      : resolve(group ? `kubernetes-models/${group}/${version}/${obj.kind}` : `kubernetes-models/${version}/${obj.kind}`);
    let Model;
    try {
      const m = await import(module);
      Model = m[obj.kind] ?? m.default?.[obj.kind] ?? m.default;
    } catch {
      console.log(`${name}: skipped (no schema for ${obj.apiVersion} ${obj.kind})`);
      continue;
    }
    try {
      new Model(obj).validate();
      console.log(`${name}: OK`);
      checked++;
    } catch (e) {
      console.error(`${name}: ${e.message.split("\n").slice(0, 4).join(" | ")}`);
      bad++;
    }
  }
}
console.log(`${checked} objects valid, ${bad} invalid`);
process.exit(bad || !checked ? 1 : 0);
