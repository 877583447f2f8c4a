// ctest driver: client/node against a real attnserve on loopback.
//   node tests/client/node_example_test.js --server BIN --example client/node/example.js --fixtures tests/fixtures
// 1. runs the example (padded, packed, cross calls, its own checks) as a user would;
// 2. serves the PyTorch golden fixtures' torch.nn.MultiheadAttention weights and checks that the
//    Node client's outputs and probabilities match PyTorch's (made by tests/fixtures/make_fixtures.py,
//    not by attnserve), in both encodings and both layouts;
// 3. checks that fromTensor reads raw bytes at an unaligned offset and writes little-endian.
// Ends the server with SIGTERM and expects exit 0. NODE_PATH names the node_modules to use.
'use strict';

const assert = require('node:assert/strict');
const { spawn, spawnSync } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { parseArgs } = require('node:util');

const { values: args } = parseArgs({ options: {
  server: { type: 'string' }, example: { type: 'string' }, fixtures: { type: 'string' },
} });
args.example = path.resolve(args.example);
const attnserve = require(path.join(path.dirname(args.example), 'attnserve.js'));
const TOLERANCE = 1e-4;  // as the C++ golden tests: float32 against PyTorch's float64 answers

// The tensors of a safetensors file (F32 only: what the data fixtures hold).
function readSafetensors(file) {
  const bytes = fs.readFileSync(file);
  const headerLength = Number(bytes.readBigUInt64LE(0));
  const header = JSON.parse(bytes.subarray(8, 8 + headerLength).toString('utf8'));
  const tensors = {};
  for (const [name, info] of Object.entries(header)) {
    if (name === '__metadata__') continue;
    assert.equal(info.dtype, 'F32', `${file}: ${name}`);
    const [begin, end] = info.data_offsets.map((o) => o + 8 + headerLength);
    const data = new Float32Array((end - begin) / 4);
    for (let i = 0; i < data.length; i++) data[i] = bytes.readFloatLE(begin + 4 * i);
    tensors[name] = { shape: info.shape, data };
  }
  return tensors;
}

function maxDifference(a, b) {
  assert.equal(a.length, b.length);
  return a.reduce((m, v, i) => Math.max(m, Math.abs(v - b[i])), 0);
}

async function startServer(workdir, models) {
  const portFile = path.join(workdir, 'port');
  const log = fs.openSync(path.join(workdir, 'server.log'), 'w');
  const proc = spawn(args.server, ['--listen', '127.0.0.1:0', '--port-file', portFile, '--threads', '2',
    '--metrics-listen=off', ...models.map((m) => `--model=${m}`)], { stdio: ['ignore', log, log] });
  let exited = null;
  proc.on('exit', (code) => { exited = code; });
  for (let i = 0; i < 600; i++) {
    if (exited !== null) throw new Error(`attnserve exited ${exited} at start`);
    const port = fs.existsSync(portFile) ? fs.readFileSync(portFile, 'utf8') : '';
    if (port.endsWith('\n')) return { proc, target: `127.0.0.1:${port.trim()}`, exitCode: () => exited };
    await new Promise((r) => setTimeout(r, 100));
  }
  proc.kill('SIGKILL');
  throw new Error('attnserve wrote no port in 60 s');
}

const KINDS = { bidirectional: 'ATTENTION_KIND_BIDIRECTIONAL', causal: 'ATTENTION_KIND_CAUSAL',
  cross: 'ATTENTION_KIND_CROSS', causal_cross: 'ATTENTION_KIND_CAUSAL_CROSS' };

// Every torch_mha fixture case through the Node client, padded/raw and packed/values.
async function checkGolden(client) {
  const manifest = JSON.parse(fs.readFileSync(path.join(args.fixtures, 'manifest.json'), 'utf8'));
  const cases = manifest.cases.filter((c) => c.weights === 'w_torch_mha.safetensors');
  assert.ok(cases.length >= 4, 'the torch_mha fixtures');
  const { pack } = require(args.example);
  for (const c of cases) {
    const t = readSafetensors(path.join(args.fixtures, c.data));
    const [B, S, d] = t.input.shape;
    const lengths = c.input.lengths;
    const request = { model: 'mha', kind: KINDS[c.kind], input: attnserve.toTensor(t.input.data, [B, S, d]),
      lengths, return_attention: true };
    const packedRequest = { model: 'mha', kind: KINDS[c.kind], lengths,
      input: attnserve.toValuesTensor(pack(t.input.data, S, d, lengths), [lengths.reduce((a, b) => a + b, 0), d]) };
    if (c.context) {
      const [Bc, Skv, dc] = t.context.shape;
      request.context = attnserve.toTensor(t.context.data, [Bc, Skv, dc]);
      request.context_lengths = c.context.lengths;
      packedRequest.context = attnserve.toValuesTensor(pack(t.context.data, Skv, dc, c.context.lengths),
        [c.context.lengths.reduce((a, b) => a + b, 0), dc]);
      packedRequest.context_lengths = c.context.lengths;
    }
    const reply = await attnserve.call(client, 'Forward', request);
    const output = attnserve.fromTensor(reply.output);
    assert.deepEqual(output.shape, [B, S, c.d_output], c.name);
    // The fixture's output is [B*S, d_output] with PyTorch's rows; padded rows are 0 in both.
    const outputError = maxDifference(output.data, t.output.data);
    assert.ok(outputError <= TOLERANCE, `${c.name}: output differs from PyTorch by ${outputError}`);
    const attention = attnserve.fromTensor(reply.attention);
    assert.deepEqual(attention.shape, t.probabilities.shape, c.name);
    const attentionError = maxDifference(attention.data, t.probabilities.data);
    assert.ok(attentionError <= TOLERANCE, `${c.name}: attention differs from PyTorch by ${attentionError}`);

    const packed = attnserve.fromTensor((await attnserve.call(client, 'Forward', packedRequest)).output);
    const packedError = maxDifference(packed.data, pack(t.output.data, S, c.d_output, lengths));
    assert.ok(packedError <= TOLERANCE, `${c.name}: packed output differs from PyTorch by ${packedError}`);
    console.log(`${c.name}: PyTorch's output within ${outputError.toExponential(1)} (padded, raw),`,
      `${packedError.toExponential(1)} (packed, values); attention within ${attentionError.toExponential(1)}`);
  }
}

// fromTensor must not depend on where the bytes sit in memory, nor on the host's byte order.
function checkRawBytes() {
  const values = [1.5, -2.25, 3.0e-8, 65504];
  const storage = Buffer.alloc(4 * values.length + 3);
  values.forEach((v, i) => storage.writeFloatLE(v, 1 + 4 * i));
  const unaligned = storage.subarray(1, 1 + 4 * values.length);  // byteOffset 1
  assert.notEqual(unaligned.byteOffset % 4, 0);
  const read = attnserve.fromTensor({ shape: [2, 2], raw: unaligned, values: [] });
  assert.deepEqual(Array.from(read.data), values.map((v) => Math.fround(v)));
  const written = attnserve.toTensor(Float32Array.from(values), [4]).raw;
  values.forEach((v, i) => assert.equal(written.readFloatLE(4 * i), Math.fround(v)));
  assert.throws(() => attnserve.fromTensor({ shape: [3], raw: Buffer.alloc(8), values: [] }), RangeError);
  console.log('raw float32: unaligned little-endian bytes read and written correctly');
}

async function main() {
  checkRawBytes();
  const workdir = fs.mkdtempSync(path.join(os.tmpdir(), 'attnserve-node-'));
  const server = await startServer(workdir,
    ['demo=built-in', `mha=${path.join(args.fixtures, 'w_torch_mha.safetensors')}`]);
  let failure = null;
  try {
    const run = spawnSync(process.execPath, [args.example, '--target', server.target, '--model', 'demo'],
      { stdio: 'inherit', timeout: 120000 });
    assert.equal(run.status, 0, `example.js exited ${run.status}`);
    const client = attnserve.connect(server.target);
    await checkGolden(client);
    client.close();
  } catch (e) {
    failure = e;
  }
  server.proc.kill('SIGTERM');
  for (let i = 0; i < 300 && server.exitCode() === null; i++) await new Promise((r) => setTimeout(r, 100));
  if (server.exitCode() === null) server.proc.kill('SIGKILL');
  const log = fs.readFileSync(path.join(workdir, 'server.log'), 'utf8');
  fs.rmSync(workdir, { recursive: true, force: true });
  if (failure) {
    console.error(log.slice(-2000));
    throw failure;
  }
  assert.equal(server.exitCode(), 0, `attnserve exited ${server.exitCode()} on SIGTERM`);
  console.log('ok');
}

main().catch((e) => { console.error(e); process.exit(1); });
