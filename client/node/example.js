#!/usr/bin/env node
// Calls attnserve from Node.js: padded, packed and cross attention, float32 in and out.
//
//   (cd client/node && npm ci)          writes client/node/node_modules (git-ignored)
//   node client/node/example.js --target localhost:50051 [--model NAME] [--proto PATH]
//
// To keep the checkout clean, install the packages elsewhere and point Node at them:
//   mkdir -p /tmp/attnserve-node && cp client/node/package*.json /tmp/attnserve-node/
//   npm ci --prefix /tmp/attnserve-node
//   NODE_PATH=/tmp/attnserve-node/node_modules node client/node/example.js
//
// With TLS (trusting a CA; mTLS adds a client certificate) and a bearer token, which is better
// given through the environment than on the command line, where `ps` shows it (the same flags as
// client/python/example.py):
//   ATTNSERVE_TOKEN=... node client/node/example.js --target server.example:50051 \
//     --tls-ca ca.pem [--tls-cert client.pem --tls-key client.key]
'use strict';

const fs = require('node:fs');

const assert = require('node:assert/strict');
const { parseArgs } = require('node:util');
const attnserve = require('./attnserve');

// A small seeded generator (mulberry32 + Box-Muller): the same inputs on every run.
function normals(count, seed) {
  let state = seed >>> 0;
  const uniform = () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return (((t ^ (t >>> 14)) >>> 0) + 0.5) / 4294967296;
  };
  const out = new Float32Array(count);
  for (let i = 0; i < count; i++) {
    out[i] = Math.sqrt(-2 * Math.log(uniform())) * Math.cos(2 * Math.PI * uniform());
  }
  return out;
}

// Rows [b, 0..n) of a padded [B, S, d] array, back to back: the packed layout.
function pack(data, S, d, lengths) {
  const packed = new Float32Array(lengths.reduce((a, b) => a + b, 0) * d);
  let row = 0;
  lengths.forEach((n, b) => {
    packed.set(data.subarray(b * S * d, (b * S + n) * d), row * d);
    row += n;
  });
  return packed;
}

async function main() {
  const { values: args } = parseArgs({ options: {
    target: { type: 'string', default: 'localhost:50051' },
    model: { type: 'string', default: '' },
    proto: { type: 'string', default: attnserve.DEFAULT_PROTO },
    'tls-ca': { type: 'string' },    // PEM CA bundle: connect with TLS, trusting it
    'tls-cert': { type: 'string' },  // PEM client certificate, for mTLS
    'tls-key': { type: 'string' },   // PEM client key, for mTLS
    token: { type: 'string', default: process.env.ATTNSERVE_TOKEN || '' },  // bearer token
  } });
  const read = (file) => (file ? fs.readFileSync(file) : null);
  const tls = { ca: read(args['tls-ca']), cert: read(args['tls-cert']), key: read(args['tls-key']) };
  const client = attnserve.connect(args.target, { protoPath: args.proto, tls, token: args.token });
  const forward = (request) => attnserve.call(client, 'Forward', request);

  // Which model, and its widths.
  const { models } = await attnserve.call(client, 'ListModels', {});
  const model = models.find((m) => m.name === args.model || !args.model);
  if (!model) throw new Error(`no model '${args.model}'; the server has ${models.map((m) => m.name)}`);
  console.log(`model ${model.name}: d_model ${model.d_model}, ${model.num_heads} heads, ${model.layout}`);
  const d = model.d_model;
  const [B, S, lengths] = [3, 6, [6, 2, 4]];
  const x = normals(B * S * d, 1);

  // 1. Padded: [B, S, d] with lengths; rows past a length are padding (masked, output 0).
  const padded = attnserve.fromTensor((await forward({
    model: model.name, kind: 'ATTENTION_KIND_CAUSAL', input: attnserve.toTensor(x, [B, S, d]), lengths,
  })).output);
  console.log(`padded causal output [${padded.shape}]`);
  assert.deepEqual(padded.shape, [B, S, d]);
  assert.ok(padded.data.subarray((1 * S + 2) * d, 2 * S * d).every((v) => v === 0), 'padded rows are 0');

  // 2. Packed: the same sequences back to back, [sum(lengths), d], no padding on the wire; here
  // in the `values` encoding, which the answer then uses too.
  const T = lengths.reduce((a, b) => a + b, 0);
  const packedReply = await forward({
    model: model.name, kind: 'ATTENTION_KIND_CAUSAL',
    input: attnserve.toValuesTensor(pack(x, S, d, lengths), [T, d]), lengths,
  });
  assert.ok(packedReply.output.values.length > 0 && packedReply.output.raw.length === 0, 'answered in values');
  const packed = attnserve.fromTensor(packedReply.output);
  console.log(`packed causal output [${packed.shape}]`);
  const paddedValid = pack(padded.data, S, d, lengths);
  const worst = paddedValid.reduce((m, v, i) => Math.max(m, Math.abs(v - packed.data[i])), 0);
  assert.ok(worst < 1e-5, `padded and packed calls agree (max difference ${worst})`);

  // 3. Cross: queries from x, keys and values from a context; a context of length 0 is fine.
  const Skv = 9;
  const context = normals(B * Skv * model.d_context, 2);
  const reply = await forward({
    model: model.name, kind: 'ATTENTION_KIND_CROSS', input: attnserve.toTensor(x, [B, S, d]), lengths,
    context: attnserve.toTensor(context, [B, Skv, model.d_context]), context_lengths: [9, 5, 0],
    return_attention: true,
  });
  const output = attnserve.fromTensor(reply.output);
  const attention = attnserve.fromTensor(reply.attention);  // [B, H, S, S_kv]
  console.log(`cross output [${output.shape}] attention [${attention.shape}]`);
  const H = model.num_heads;
  const at = (b, h, i, j) => attention.data[((b * H + h) * S + i) * Skv + j];
  for (let h = 0; h < H; h++) {
    for (let i = 0; i < 2; i++) {
      let sum = 0;
      for (let j = 0; j < Skv; j++) {
        sum += at(1, h, i, j);
        if (j >= 5) assert.equal(at(1, h, i, j), 0, 'keys past the context length get nothing');
      }
      assert.ok(Math.abs(sum - 1) < 1e-5, `valid rows sum to 1 (${sum})`);
    }
  }
  assert.ok(attention.data.subarray(2 * H * S * Skv).every((v) => v === 0), 'an empty context is attended by nobody');

  // Errors come back as gRPC status codes.
  await assert.rejects(forward({
    model: 'no-such-model', kind: 'ATTENTION_KIND_CAUSAL', input: attnserve.toTensor(x, [B, S, d]),
  }), (e) => e.code === attnserve.grpc.status.NOT_FOUND);
  console.log('unknown model -> NOT_FOUND');
  client.close();
  console.log('ok');
}

if (require.main === module) {
  main().catch((e) => { console.error(e); process.exit(1); });
}
module.exports = { normals, pack };
