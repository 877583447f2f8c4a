// ctest driver: client/node against a real attnserve on loopback.
//   node tests/client/node_example_test.js --server BIN --example client/node/example.js --fixtures tests/fixtures
// 1. runs the example (padded, packed, cross calls, its own checks) as a user would;
// 2. serves the PyTorch golden fixtures' torch.nn.MultiheadAttention weights and checks that the
//    Node client's outputs and probabilities match PyTorch's (made by tests/fixtures/make_fixtures.py,
//    not by attnserve), in both encodings and both layouts;
// 3. checks that fromTensor reads raw bytes at an unaligned offset and writes little-endian;
// 4. runs the example against a server with mutual TLS and bearer tokens (certificates made by
//    openssl here): answered with the client certificate and the token (from ATTNSERVE_TOKEN,
//    then from --token), UNAUTHENTICATED without the token, refused without the certificate.
// Ends the servers with SIGTERM and expects exit 0. NODE_PATH names the node_modules to use.
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

async function startServer(workdir, models, extra = [], name = 'server') {
  const portFile = path.join(workdir, `${name}.port`);
  const log = fs.openSync(path.join(workdir, `${name}.log`), 'w');
  const proc = spawn(args.server, ['--listen', '127.0.0.1:0', '--port-file', portFile, '--threads', '2',
    '--metrics-listen=off', ...models.map((m) => `--model=${m}`), ...extra], { stdio: ['ignore', log, log] });
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

// SIGTERM, then the exit code (SIGKILL and null after 30 s).
async function stopServer(server) {
  server.proc.kill('SIGTERM');
  for (let i = 0; i < 300 && server.exitCode() === null; i++) await new Promise((r) => setTimeout(r, 100));
  if (server.exitCode() === null) server.proc.kill('SIGKILL');
  return server.exitCode();
}

// A CA, a server certificate for localhost and a client certificate, both signed by the CA.
function makeCertificates(dir) {
  const openssl = (...argv) => {
    const run = spawnSync('openssl', argv, { cwd: dir, encoding: 'utf8' });
    assert.equal(run.status, 0, `openssl ${argv.join(' ')}: ${run.stderr}`);
  };
  openssl('req', '-x509', '-newkey', 'rsa:2048', '-nodes', '-keyout', 'ca.key', '-out', 'ca.pem',
    '-days', '1', '-subj', '/CN=attnserve-test-ca');
  fs.writeFileSync(path.join(dir, 'san.ext'), 'subjectAltName=DNS:localhost,IP:127.0.0.1\n');
  for (const [name, subject, ext] of [['server', '/CN=localhost', ['-extfile', 'san.ext']],
    ['client', '/CN=attnserve-test-client', []]]) {
    openssl('req', '-newkey', 'rsa:2048', '-nodes', '-keyout', `${name}.key`, '-out', `${name}.csr`,
      '-subj', subject);
    openssl('x509', '-req', '-in', `${name}.csr`, '-CA', 'ca.pem', '-CAkey', 'ca.key', '-CAcreateserial',
      '-out', `${name}.pem`, '-days', '1', ...ext);
  }
  const file = (n) => path.join(dir, n);
  return { ca: file('ca.pem'), cert: file('server.pem'), key: file('server.key'),
    clientCert: file('client.pem'), clientKey: file('client.key') };
}

// example.js --tls-ca/--tls-cert/--tls-key with a token against a server with mTLS and tokens.
async function checkExampleOverMtlsWithToken(workdir) {
  const pem = makeCertificates(workdir);
  const tokens = path.join(workdir, 'tokens');
  fs.writeFileSync(tokens, 'node-token-1\n');
  const server = await startServer(workdir, ['demo=built-in'], ['--tls-cert', pem.cert, '--tls-key', pem.key,
    '--tls-client-ca', pem.ca, '--auth-token-file', tokens], 'mtls');
  const target = server.target.replace('127.0.0.1', 'localhost');  // the name the certificate holds
  const base = [args.example, '--target', target, '--model', 'demo', '--tls-ca', pem.ca];
  const mtls = [...base, '--tls-cert', pem.clientCert, '--tls-key', pem.clientKey];
  const env = { ...process.env };
  delete env.ATTNSERVE_TOKEN;
  const run = (argv, token) => spawnSync(process.execPath, argv, { encoding: 'utf8', timeout: 120000,
    env: token ? { ...env, ATTNSERVE_TOKEN: token } : env });
  let failure = null;
  try {
    let done = run(mtls, 'node-token-1');
    assert.equal(done.status, 0, `with ATTNSERVE_TOKEN: exit ${done.status}\n${done.stdout}${done.stderr}`);
    done = run([...mtls, '--token', 'node-token-1']);
    assert.equal(done.status, 0, `with --token: exit ${done.status}\n${done.stderr}`);
    done = run(mtls);
    assert.ok(done.status !== 0 && /UNAUTHENTICATED/.test(done.stderr), `no token: ${done.stderr}`);
    done = run([...base, '--token', 'node-token-1']);
    assert.ok(done.status !== 0 && /UNAVAILABLE/.test(done.stderr), `no client certificate: ${done.stderr}`);
    console.log('example.js over mTLS: answered with the token (ATTNSERVE_TOKEN or --token),',
      'UNAUTHENTICATED without it, UNAVAILABLE without the client certificate');
  } catch (e) {
    failure = e;
  }
  const code = await stopServer(server);
  if (failure) {
    console.error(fs.readFileSync(path.join(workdir, 'mtls.log'), 'utf8').slice(-2000));
    throw failure;
  }
  assert.equal(code, 0, `the mTLS attnserve exited ${code} on SIGTERM`);
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
  const code = await stopServer(server);
  const log = fs.readFileSync(path.join(workdir, 'server.log'), 'utf8');
  if (failure) {
    fs.rmSync(workdir, { recursive: true, force: true });
    console.error(log.slice(-2000));
    throw failure;
  }
  assert.equal(code, 0, `attnserve exited ${code} on SIGTERM`);
  try {
    await checkExampleOverMtlsWithToken(workdir);
  } finally {
    fs.rmSync(workdir, { recursive: true, force: true });
  }
  console.log('ok');
}

main().catch((e) => { console.error(e); process.exit(1); });
