#!/usr/bin/python3
"""Saves an attention layer's state_dict as a safetensors file that attnserve loads.

Needs numpy only (the `safetensors` package is not in Debian 12; where you have it,
`safetensors.torch.save_file(sd, path, metadata={"num_heads": "12"})` writes the same file):

    import sys; sys.path.insert(0, "client/python")
    from save_layer import save_layer
    layer = torch.nn.MultiheadAttention(768, 12, batch_first=True)
    save_layer("mha.safetensors", layer.state_dict(), num_heads=12)

Values are stored as float32; `num_heads` goes into the header's __metadata__, where attnserve
reads it (the server's `--model NAME=PATH:num_heads=N` overrides it).
"""
import json
import struct

import numpy as np


def _as_float32(value):
    """A torch tensor or anything numpy takes -> C-order little-endian float32 array."""
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch
        value = value.detach().cpu().float().numpy()
    return np.ascontiguousarray(value, dtype="<f4")


def save_layer(path, state_dict, num_heads):
    """Writes {name: tensor} to `path` in the safetensors format, with num_heads metadata."""
    header = {"__metadata__": {"num_heads": str(int(num_heads))}}
    blobs, offset = [], 0
    for name, value in state_dict.items():
        array = _as_float32(value)
        data = array.tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
