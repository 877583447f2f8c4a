// attnserve from Node.js: the stubs from the .proto at run time (@grpc/proto-loader), a client
// with raised message limits and the retry policy, and float32 tensors in and out.
'use strict';

const os = require('node:os');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

// The repository's proto, found from this file; pass another path when the example moves.
const DEFAULT_PROTO = path.join(__dirname, '..', '..', 'proto', 'attnserve', 'v1', 'attention.proto');

// Forward and ListModels are pure functions of their request: a call cut off with its replica
// (UNAVAILABLE) is safe to send again, to another replica. The same JSON as the C++ client's.
const RETRY_SERVICE_CONFIG = {
  methodConfig: [{
    name: [{ service: 'attnserve.v1.AttentionService', method: 'Forward' },
           { service: 'attnserve.v1.AttentionService', method: 'ListModels' }],
    retryPolicy: {
      maxAttempts: 5,
      initialBackoff: '0.1s',
      maxBackoff: '1s',
      backoffMultiplier: 2,
      retryableStatusCodes: ['UNAVAILABLE'],
    },
  }],
};

// Loads attnserve.v1 from the .proto: enums as their names, int64 (shapes) as Numbers.
function loadProto(protoPath = DEFAULT_PROTO) {
  const definition = protoLoader.loadSync(protoPath, {
    keepCase: true, longs: Number, enums: String, defaults: true,
  });
  return grpc.loadPackageDefinition(definition).attnserve.v1;
}

// Channel credentials: plaintext, or TLS when `tls.ca` is given (PEM, a Buffer or string),
// trusting that CA; mTLS adds this client's `tls.cert` and `tls.key`.
function channelCredentials(tls) {
  if (!tls || !tls.ca) {
    if (tls && (tls.cert || tls.key)) throw new Error('a client certificate needs TLS: give tls.ca too');
    return grpc.credentials.createInsecure();
  }
  if (!tls.cert !== !tls.key) throw new Error('tls.cert and tls.key go together');
  const pem = (v) => (v ? Buffer.from(v) : null);
  return grpc.credentials.createSsl(pem(tls.ca), pem(tls.key), pem(tls.cert));
}

// An interceptor that sends `authorization: Bearer TOKEN` on every call (plaintext or TLS).
function bearerToken(token) {
  return (options, nextCall) => new grpc.InterceptingCall(nextCall(options), {
    start(metadata, listener, next) {
      metadata.set('authorization', `Bearer ${token}`);
      next(metadata, listener);
    },
  });
}

// A client of attnserve.v1.AttentionService. gRPC's default 4 MiB receive limit would refuse
// most answers (an attention tensor grows as S²): both limits are raised to maxMessageBytes.
// `tls` ({ ca, cert, key }: PEM contents) and `token` (a bearer token) as the server asks.
function connect(target, { protoPath, maxMessageBytes = 256 << 20, retry = true,
                           lbPolicy = '', tls = null, token = '' } = {}) {
  const v1 = loadProto(protoPath);
  const options = {
    'grpc.max_receive_message_length': maxMessageBytes,
    'grpc.max_send_message_length': maxMessageBytes,
  };
  if (token) options.interceptors = [bearerToken(token)];
  if (retry) {
    options['grpc.service_config'] = JSON.stringify(lbPolicy
      ? { ...RETRY_SERVICE_CONFIG, loadBalancingConfig: [{ [lbPolicy]: {} }] }
      : RETRY_SERVICE_CONFIG);
    // A request is kept for retrying only up to this size; past it a call is never retried.
    options['grpc.per_rpc_retry_buffer_size'] = maxMessageBytes;
    options['grpc.retry_buffer_size'] = maxMessageBytes;
  } else {
    options['grpc.enable_retries'] = 0;
    if (lbPolicy) {
      options['grpc.service_config'] = JSON.stringify({ loadBalancingConfig: [{ [lbPolicy]: {} }] });
    }
  }
  return new v1.AttentionService(target, channelCredentials(tls), options);
}

// Calls `method` on `client` as a Promise, with a deadline.
function call(client, method, request, timeoutSeconds = 30) {
  const deadline = new Date(Date.now() + timeoutSeconds * 1000);
  return new Promise((resolve, reject) => {
    client[method](request, { deadline }, (error, response) => (error ? reject(error) : resolve(response)));
  });
}

const littleEndian = os.endianness() === 'LE';

// A Tensor message from a Float32Array and its shape, as `raw`: little-endian float32 bytes.
function toTensor(data, shape) {
  if (!(data instanceof Float32Array)) throw new TypeError('toTensor wants a Float32Array');
  if (shape.reduce((a, b) => a * b, 1) !== data.length) {
    throw new RangeError(`shape [${shape}] does not hold ${data.length} values`);
  }
  let raw;
  if (littleEndian) {
    raw = Buffer.from(data.buffer, data.byteOffset, data.byteLength);  // a view: no copy
  } else {
    raw = Buffer.alloc(data.byteLength);
    for (let i = 0; i < data.length; i++) raw.writeFloatLE(data[i], 4 * i);
  }
  return { shape, raw };
}

// The same with `values` (repeated float): slower to encode, readable in logs and JSON tools.
function toValuesTensor(data, shape) {
  if (shape.reduce((a, b) => a * b, 1) !== data.length) {
    throw new RangeError(`shape [${shape}] does not hold ${data.length} values`);
  }
  return { shape, values: Array.from(data) };
}

// { shape, data: Float32Array } from a Tensor message; the server answers in the request's
// encoding. A decoded `raw` Buffer is a slice of the message at any byte offset, and a
// Float32Array needs a 4-byte aligned offset: the bytes are copied into a fresh ArrayBuffer.
function fromTensor(tensor) {
  const shape = tensor.shape.map(Number);
  const count = shape.reduce((a, b) => a * b, 1);
  if (tensor.raw && tensor.raw.length > 0) {
    if (tensor.raw.length !== 4 * count) {
      throw new RangeError(`raw holds ${tensor.raw.length} bytes, shape [${shape}] needs ${4 * count}`);
    }
    const data = new Float32Array(count);
    if (littleEndian) {
      new Uint8Array(data.buffer).set(tensor.raw);
    } else {
      for (let i = 0; i < count; i++) data[i] = tensor.raw.readFloatLE(4 * i);
    }
    return { shape, data };
  }
  if (tensor.values.length !== count) {
    throw new RangeError(`values holds ${tensor.values.length} numbers, shape [${shape}] needs ${count}`);
  }
  return { shape, data: Float32Array.from(tensor.values) };
}

module.exports = {
  DEFAULT_PROTO, RETRY_SERVICE_CONFIG, grpc, loadProto, connect, call, toTensor, toValuesTensor,
  fromTensor,
};
