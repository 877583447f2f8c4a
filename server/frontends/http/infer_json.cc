#include "server/frontends/http/infer_json.h"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cstring>
#include <initializer_list>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/float16.h"
#include "core/layer_spec.h"
#include "server/frontends/http/http_status.h"
#include "server/frontends/oip/infer_codec.h"
#include "server/frontends/tensor_codec.h"
#include "server/observability/logging.h"
#include "simdjson.h"

namespace attnserve::server {
namespace {

static_assert(std::endian::native == std::endian::little,
              "binary tensors are little-endian, read in place");

namespace ondemand = simdjson::ondemand;

// The input tensors of the contract, in the order ModelMetadata lists them.
constexpr const char* kInputNames[] = {kInferInput, kInferLengths, kInferContext,
                                       kInferContextLengths};

absl::Status Invalid(absl::string_view tensor, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("tensor '", Clipped(tensor), "': ", what));
}

absl::Status JsonError(simdjson::error_code error, absl::string_view where) {
  return absl::InvalidArgumentError(
      absl::StrCat("malformed JSON (", where, "): ", simdjson::error_message(error)));
}

#define ATTNSERVE_JSON(expr, where)                                                  \
  if (simdjson::error_code json_error_ = (expr); json_error_ != simdjson::SUCCESS) { \
    return JsonError(json_error_, where);                                            \
  }

// One input as the JSON header describes it; its data is read in the second pass.
struct JsonInput {
  std::string name, datatype;
  std::vector<int64_t> shape;
  int64_t binary_size = -1;  // parameters.binary_data_size: its data is in the binary part
  bool has_data = false;
  absl::string_view bytes;  // its binary data
};

// The request's header, the first pass.
struct JsonRequest {
  std::string id;
  std::optional<std::string> kind;
  bool return_attention = false;
  bool binary_output = false;              // parameters.binary_data_output
  std::optional<std::string> sequence_id;  // as text, a string quoted (SequenceParams::id)
  bool sequence_start = false, sequence_end = false;
  std::vector<JsonInput> inputs;
  std::vector<std::pair<std::string, std::optional<bool>>> outputs;  // name, binary_data
};

absl::StatusOr<std::string> String(ondemand::value value, absl::string_view where) {
  std::string_view text;
  ATTNSERVE_JSON(value.get_string().get(text), where);
  return std::string(text);
}

absl::StatusOr<bool> Bool(ondemand::value value, absl::string_view where) {
  bool flag = false;
  ATTNSERVE_JSON(value.get_bool().get(flag), where);
  return flag;
}

// The keys an object's reader uses, each allowed once: a repeat would be read again, the last
// one winning (or, at the top level, make the two passes disagree). Other keys are only checked
// as JSON, however often they come: a flag for each known key, not a set of every key seen, so
// that an object of millions of keys costs no more than reading it.
class KnownKeys {
 public:
  KnownKeys(std::initializer_list<std::string_view> keys) : keys_(keys), seen_(keys.size()) {}

  // Whether `key` is one of the keys, seen before.
  bool Repeated(std::string_view key) {
    for (size_t i = 0; i < keys_.size(); ++i) {
      if (keys_[i] != key) continue;
      if (seen_[i]) return true;
      seen_[i] = true;
    }
    return false;
  }

  // InvalidArgument naming `key`, given twice.
  static absl::Status Twice(std::string_view key) {
    return absl::InvalidArgumentError(
        absl::StrCat("key '", Clipped(absl::string_view(key.data(), key.size())), "' given twice"));
  }

 private:
  std::vector<std::string_view> keys_;
  std::vector<bool> seen_;
};

// Calls `on_field(key, value)` for each field of the object `value`.
template <typename F>
absl::Status ForEachField(ondemand::value value, absl::string_view where, F&& on_field) {
  ondemand::object object;
  ATTNSERVE_JSON(value.get_object().get(object), where);
  for (auto field : object) {
    std::string_view key;
    ATTNSERVE_JSON(field.unescaped_key().get(key), where);
    ondemand::value item;
    ATTNSERVE_JSON(field.value().get(item), where);
    if (absl::Status status = on_field(key, item); !status.ok()) return status;
  }
  return absl::OkStatus();
}

// Calls `on_item(value)` for each element of the array `value`.
template <typename F>
absl::Status ForEachItem(ondemand::value value, absl::string_view where, F&& on_item) {
  ondemand::array array;
  ATTNSERVE_JSON(value.get_array().get(array), where);
  for (auto element : array) {
    ondemand::value item;
    ATTNSERVE_JSON(element.get(item), where);
    if (absl::Status status = on_item(item); !status.ok()) return status;
  }
  return absl::OkStatus();
}

// Reads a value nobody uses (an unknown key's) through, so that it is checked too: on-demand
// parsing checks only what it reads, and malformed JSON is refused wherever it is.
absl::Status CheckValue(ondemand::value value, int depth = 0) {
  if (depth > 64) return absl::InvalidArgumentError("malformed JSON: nested too deep");
  ondemand::json_type type;
  ATTNSERVE_JSON(value.type().get(type), "a value");
  switch (type) {
    case ondemand::json_type::object:
      return ForEachField(value, "an object", [&](std::string_view, ondemand::value item) {
        return CheckValue(item, depth + 1);
      });
    case ondemand::json_type::array:
      return ForEachItem(value, "an array",
                         [&](ondemand::value item) { return CheckValue(item, depth + 1); });
    case ondemand::json_type::number: {
      double number = 0;
      ATTNSERVE_JSON(value.get_double().get(number), "a number");
      return absl::OkStatus();
    }
    case ondemand::json_type::string: {
      std::string_view text;
      ATTNSERVE_JSON(value.get_string().get(text), "a string");
      return absl::OkStatus();
    }
    case ondemand::json_type::boolean: {
      bool flag = false;
      ATTNSERVE_JSON(value.get_bool().get(flag), "a boolean");
      return absl::OkStatus();
    }
    default: {
      bool null = false;
      ATTNSERVE_JSON(value.is_null().get(null), "a value");
      if (!null) return absl::InvalidArgumentError("malformed JSON: not a value");
      return absl::OkStatus();
    }
  }
}

// A sequence_id: an unsigned integer or a string, as the gRPC form's uint64 or string.
absl::StatusOr<std::string> SequenceId(ondemand::value value) {
  constexpr char kWhat[] = "parameter 'sequence_id' must be an unsigned integer or a string";
  ondemand::json_type type;
  ATTNSERVE_JSON(value.type().get(type), kWhat);
  if (type == ondemand::json_type::string) {
    absl::StatusOr<std::string> id = String(value, kWhat);
    if (!id.ok()) return id.status();
    return absl::StrCat("'", *id, "'");
  }
  uint64_t id = 0;
  ATTNSERVE_JSON(value.get_uint64().get(id), kWhat);
  return absl::StrCat(id);
}

// The request's `parameters`: kind, return_attention, binary_data_output and the sequence
// parameters; others are ignored as the gRPC form ignores them.
absl::Status ReadParameters(ondemand::value value, JsonRequest* request) {
  KnownKeys known{kSequenceIdParameter, kSequenceStartParameter,        kSequenceEndParameter,
                  kInferKindParameter,  kInferReturnAttentionParameter, "binary_data_output"};
  return ForEachField(value, "parameters", [&](std::string_view key, ondemand::value item) {
    if (known.Repeated(key)) return KnownKeys::Twice(key);
    if (key == kSequenceIdParameter) {
      absl::StatusOr<std::string> id = SequenceId(item);
      if (!id.ok()) return id.status();
      request->sequence_id = *std::move(id);
      return absl::OkStatus();
    }
    if (key == kSequenceStartParameter || key == kSequenceEndParameter) {
      const bool start = key == kSequenceStartParameter;
      absl::StatusOr<bool> flag = Bool(item, start ? "parameter 'sequence_start' must be a bool"
                                                   : "parameter 'sequence_end' must be a bool");
      if (!flag.ok()) return flag.status();
      (start ? request->sequence_start : request->sequence_end) = *flag;
      return absl::OkStatus();
    }
    if (key == kInferKindParameter) {
      absl::StatusOr<std::string> kind = String(item, "parameter 'kind' must be a string");
      if (!kind.ok()) return kind.status();
      request->kind = *std::move(kind);
    } else if (key == kInferReturnAttentionParameter) {
      absl::StatusOr<bool> flag = Bool(item, "parameter 'return_attention' must be a bool");
      if (!flag.ok()) return flag.status();
      request->return_attention = *flag;
    } else if (key == "binary_data_output") {
      absl::StatusOr<bool> flag = Bool(item, "parameter 'binary_data_output' must be a bool");
      if (!flag.ok()) return flag.status();
      request->binary_output = *flag;
    } else {
      return CheckValue(item);
    }
    return absl::OkStatus();
  });
}

absl::Status ReadShape(ondemand::value value, JsonInput* input) {
  return ForEachItem(value, "shape", [&](ondemand::value item) {
    int64_t dim = 0;
    ATTNSERVE_JSON(item.get_int64().get(dim), "a shape holds integers");
    if (dim < 0 || input->shape.size() >= 8) {
      return Invalid(input->name, "shape must hold at most 8 dimensions, none negative");
    }
    input->shape.push_back(dim);
    return absl::OkStatus();
  });
}

// One element of `inputs`, without its data.
absl::Status ReadInput(ondemand::value value, JsonRequest* request) {
  JsonInput& input = request->inputs.emplace_back();
  KnownKeys known{"name", "datatype", "shape", "data", "parameters"};
  return ForEachField(value, "inputs", [&](std::string_view key, ondemand::value item) {
    if (known.Repeated(key)) return Invalid(input.name, KnownKeys::Twice(key).message());
    absl::Status status;
    if (key == "name") {
      absl::StatusOr<std::string> name = String(item, "an input's name must be a string");
      if (name.ok()) input.name = *std::move(name);
      status = name.status();
    } else if (key == "datatype") {
      absl::StatusOr<std::string> type = String(item, "a datatype must be a string");
      if (type.ok()) input.datatype = *std::move(type);
      status = type.status();
    } else if (key == "shape") {
      status = ReadShape(item, &input);
    } else if (key == "data") {
      input.has_data = true;  // read in the second pass, once the datatype is known
    } else if (key == "parameters") {
      KnownKeys known_parameters{"binary_data_size"};
      status = ForEachField(item, "parameters", [&](std::string_view name, ondemand::value p) {
        if (known_parameters.Repeated(name))
          return Invalid(input.name, KnownKeys::Twice(name).message());
        if (name != "binary_data_size") return CheckValue(p);
        int64_t size = 0;
        ATTNSERVE_JSON(p.get_int64().get(size), "binary_data_size must be an integer");
        if (size < 0) return Invalid(input.name, "binary_data_size must be >= 0");
        input.binary_size = size;
        return absl::OkStatus();
      });
    } else {
      status = CheckValue(item);
    }
    return status;
  });
}

// One element of `outputs`: a name and, maybe, parameters.binary_data.
absl::Status ReadOutput(ondemand::value value, JsonRequest* request) {
  // References, not a structured binding: clang-14 (the fuzz build) cannot capture one.
  auto& output = request->outputs.emplace_back();
  std::string& name = output.first;
  std::optional<bool>& binary = output.second;
  KnownKeys known{"name", "parameters"};
  return ForEachField(value, "outputs", [&](std::string_view key, ondemand::value item) {
    if (known.Repeated(key)) return KnownKeys::Twice(key);
    if (key == "name") {
      absl::StatusOr<std::string> text = String(item, "an output's name must be a string");
      if (text.ok()) name = *std::move(text);
      return text.status();
    }
    if (key != "parameters") return CheckValue(item);
    KnownKeys known_parameters{"binary_data"};
    return ForEachField(item, "parameters", [&](std::string_view p, ondemand::value flag) {
      if (known_parameters.Repeated(p)) return KnownKeys::Twice(p);
      if (p != "binary_data") return CheckValue(flag);
      absl::StatusOr<bool> on = Bool(flag, "binary_data must be a bool");
      if (on.ok()) binary = *on;
      return on.status();
    });
  });
}

// The first pass over the document: everything but the tensors' data.
absl::Status ReadHeader(ondemand::document& document, JsonRequest* request) {
  ondemand::value root;
  ATTNSERVE_JSON(document.get_value().get(root), "the request");
  KnownKeys known{"id", "parameters", "inputs", "outputs"};
  return ForEachField(
      root, "the request must be an object", [&](std::string_view key, ondemand::value item) {
        if (known.Repeated(key)) return KnownKeys::Twice(key);
        if (key == "id") {
          absl::StatusOr<std::string> id = String(item, "id must be a string");
          if (id.ok()) request->id = *std::move(id);
          return id.status();
        }
        if (key == "parameters") return ReadParameters(item, request);
        if (key == "inputs") {
          return ForEachItem(item, "inputs must be an array",
                             [&](ondemand::value input) { return ReadInput(input, request); });
        }
        if (key == "outputs") {
          return ForEachItem(item, "outputs must be an array",
                             [&](ondemand::value output) { return ReadOutput(output, request); });
        }
        return CheckValue(item);
      });
}

// Appends one number to `out` (FP32: the double rounded to float; INT32: an exact integer).
template <typename T>
absl::Status AppendNumber(ondemand::value value, const JsonInput& input, std::vector<T>* out) {
  if constexpr (std::is_same_v<T, float>) {
    double number = 0;
    ATTNSERVE_JSON(value.get_double().get(number), "FP32 data holds numbers");
    out->push_back(static_cast<float>(number));
  } else {
    int64_t number = 0;
    ATTNSERVE_JSON(value.get_int64().get(number), "INT32 data holds integers");
    if (number < INT32_MIN || number > INT32_MAX) return Invalid(input.name, "INT32 out of range");
    out->push_back(static_cast<int32_t>(number));
  }
  return absl::OkStatus();
}

// Appends the numbers of the array `value` (nested up to `depth` levels, or flat) to `out`, at
// most `limit` of them. An array whose first element is a number is read as numbers only: the
// loop over a tensor's values does nothing else.
template <typename T>
absl::Status ReadNumbers(ondemand::value value, int depth, size_t limit, const JsonInput& input,
                         std::vector<T>* out) {
  if (depth == 0) return Invalid(input.name, "data is nested deeper than its shape");
  ondemand::array array;
  ATTNSERVE_JSON(value.get_array().get(array), "data must be an array");
  bool leaf = true, first = true;
  for (auto element : array) {
    ondemand::value item;
    ATTNSERVE_JSON(element.get(item), "data");
    if (first) {
      ondemand::json_type type;
      ATTNSERVE_JSON(item.type().get(type), "data");
      leaf = type != ondemand::json_type::array;
      first = false;
    }
    absl::Status status;
    if (!leaf) {
      status = ReadNumbers(item, depth - 1, limit, input, out);
    } else if (out->size() >= limit) {
      status = Invalid(input.name, "data holds more values than its shape");
    } else {
      status = AppendNumber(item, input, out);
    }
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

// The elements `input`'s shape holds; InvalidArgument when it overflows.
absl::StatusOr<int64_t> ShapeCount(const JsonInput& input) {
  int64_t count = 1;
  for (int64_t dim : input.shape) {
    if (dim != 0 && count > INT64_MAX / 4 / dim) return Invalid(input.name, "shape too large");
    count *= dim;
  }
  return count;
}

// Reads the JSON `data` of `input` (the second pass found it) into `out`.
template <typename T>
absl::Status ReadData(ondemand::value value, const JsonInput& input, size_t body_size,
                      std::vector<T>* out) {
  absl::StatusOr<int64_t> count = ShapeCount(input);
  if (!count.ok()) return count.status();
  // A number takes at least two bytes of text: a shape larger than the body allows is refused
  // before anything is allocated for it.
  if (*count > static_cast<int64_t>(body_size / 2 + 1)) {
    return Invalid(input.name, absl::StrCat("shape of ", *count, " elements, more than the data"));
  }
  out->clear();
  out->reserve(*count);
  const int depth = std::max<int>(1, static_cast<int>(input.shape.size()));
  if (absl::Status status = ReadNumbers(value, depth, *count, input, out); !status.ok()) {
    return status;
  }
  if (static_cast<int64_t>(out->size()) != *count) {
    return Invalid(input.name,
                   absl::StrCat("data holds ", out->size(), " values for a shape of ", *count));
  }
  return absl::OkStatus();
}

bool IsFloatType(absl::string_view type) {
  return type == "FP32" || type == "FP16" || type == "BF16";
}

// Reads the binary bytes of a float input (FP32 in place where aligned; FP16, BF16 converted).
absl::StatusOr<const float*> BinaryFloats(const JsonInput& input, int64_t count,
                                          std::vector<float>* copy) {
  if (input.datatype == "FP32") {
    absl::StatusOr<const float*> data = RawFloats(input.bytes, count, copy);
    if (!data.ok())
      return Invalid(input.name, absl::StrCat("binary data ", data.status().message()));
    return data;
  }
  if (static_cast<int64_t>(input.bytes.size()) != count * 2) {
    return Invalid(input.name,
                   absl::StrCat("binary_data_size is ", input.bytes.size(), " bytes for ", count,
                                " ", input.datatype, " elements"));
  }
  copy->resize(count);
  const bool fp16 = input.datatype == "FP16";
  for (int64_t i = 0; i < count; ++i) {
    uint16_t value;
    std::memcpy(&value, input.bytes.data() + 2 * i, sizeof(value));
    (*copy)[i] = fp16 ? core::HalfToFloat(value) : core::BFloat16ToFloat(value);
  }
  return copy->data();
}

// One input of the contract as the request gave it.
struct InputData {
  const JsonInput* input = nullptr;
  bool json = false;  // its data was JSON text, read into the decoded call's copy
};

absl::Status CheckDatatype(const JsonInput& input, bool lengths) {
  if (lengths) {
    if (input.datatype != "INT32") {
      return Invalid(input.name, absl::StrCat("datatype '", Clipped(input.datatype),
                                              "' is not served; send INT32"));
    }
    if (input.shape.size() != 1) return Invalid(input.name, "shape must be [B]");
    return absl::OkStatus();
  }
  if (!IsFloatType(input.datatype)) {
    return Invalid(input.name, absl::StrCat("datatype '", Clipped(input.datatype),
                                            "' is not served; send FP32, FP16 or BF16"));
  }
  if (input.datatype != "FP32" && input.binary_size < 0) {
    return Invalid(input.name, absl::StrCat(input.datatype,
                                            " travels as binary data (binary_data_size), "
                                            "not JSON numbers"));
  }
  return absl::OkStatus();
}

// The lengths of `source`: read from JSON already, or binary INT32 copied into `copy`.
absl::StatusOr<std::span<const int32_t>> LengthsData(const InputData& source,
                                                     std::vector<int32_t>* copy) {
  const JsonInput& input = *source.input;
  if (source.json) return std::span<const int32_t>(*copy);
  // (Divided, not multiplied: a shape of 2^62 elements times 4 wraps to 0 bytes.)
  if (input.shape[0] < 0 || input.bytes.size() % 4 != 0 ||
      static_cast<int64_t>(input.bytes.size() / 4) != input.shape[0]) {
    return Invalid(input.name, absl::StrCat("binary_data_size is ", input.bytes.size(),
                                            " bytes for ", input.shape[0], " INT32 elements"));
  }
  copy->resize(input.shape[0]);
  std::memcpy(copy->data(), input.bytes.data(), input.bytes.size());
  return std::span<const int32_t>(*copy);
}

// One batch tensor (`input` or `context`) and its optional lengths, decoded into `batch`.
absl::Status DecodeBatch(const InputData& data, const InputData* lengths, std::vector<float>* copy,
                         std::vector<int32_t>* lengths_copy, core::RaggedBatch* batch) {
  const JsonInput& input = *data.input;
  const std::string what = absl::StrCat("tensor '", Clipped(input.name), "'");
  absl::StatusOr<int64_t> count = ElementCount(input.shape, what);
  if (!count.ok()) return count.status();
  const float* floats = copy->data();
  if (!data.json) {
    absl::StatusOr<const float*> read = BinaryFloats(input, *count, copy);
    if (!read.ok()) return read.status();
    floats = *read;
  }
  std::span<const int32_t> given;
  if (lengths != nullptr) {
    absl::StatusOr<std::span<const int32_t>> read = LengthsData(*lengths, lengths_copy);
    if (!read.ok()) return read.status();
    given = *read;
  }
  return MakeBatch(input.shape, floats, given, what, batch);
}

// Matches the inputs to the contract's names and hands out the binary part in order.
absl::Status AssignInputs(absl::string_view binary, JsonRequest* request, InputData (&found)[4]) {
  size_t offset = 0;
  for (JsonInput& input : request->inputs) {
    const auto* name = std::find(std::begin(kInputNames), std::end(kInputNames), input.name);
    if (name == std::end(kInputNames)) {
      return Invalid(input.name,
                     "not an input of the model (input, lengths, context, "
                     "context_lengths)");
    }
    InputData& slot = found[name - std::begin(kInputNames)];
    if (slot.input != nullptr) return Invalid(input.name, "given twice");
    slot.input = &input;
    if (input.binary_size >= 0) {
      if (input.has_data) return Invalid(input.name, "both data and binary_data_size are set");
      if (static_cast<uint64_t>(input.binary_size) > binary.size() - offset) {
        return Invalid(input.name, "binary_data_size runs past the end of the body");
      }
      input.bytes = binary.substr(offset, input.binary_size);
      offset += input.binary_size;
    } else if (!input.has_data) {
      return Invalid(input.name, "no data and no binary_data_size");
    }
  }
  if (offset != binary.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the body holds ", binary.size() - offset,
                                                   " bytes of binary data no input claims"));
  }
  return absl::OkStatus();
}

// Reads the JSON `data` of the input in contract slot `slot` into the decoded call's copy.
absl::Status ReadSlotData(ondemand::value data, int slot, const JsonInput& input, size_t body_size,
                          DecodedHttpInfer* decoded) {
  switch (slot) {
    case 0:
      return ReadData(data, input, body_size, &decoded->input_copy);
    case 1:
      return ReadData(data, input, body_size, &decoded->lengths_copy);
    case 2:
      return ReadData(data, input, body_size, &decoded->context_copy);
    default:
      return ReadData(data, input, body_size, &decoded->context_lengths_copy);
  }
}

// The second pass: the JSON `data` of each input, read in document order (on-demand parsing
// reads forward only), once every datatype is checked.
absl::Status ReadJsonData(ondemand::document& document, const JsonRequest& request,
                          size_t body_size, InputData (&found)[4], DecodedHttpInfer* decoded) {
  for (int slot = 0; slot < 4; ++slot) {
    if (found[slot].input == nullptr) continue;
    absl::Status status = CheckDatatype(*found[slot].input, /*lengths=*/slot % 2 == 1);
    if (!status.ok()) return status;
  }
  document.rewind();
  ondemand::value inputs;
  ATTNSERVE_JSON(document["inputs"].get(inputs), "inputs");
  size_t index = 0;
  return ForEachItem(inputs, "inputs", [&](ondemand::value item) {
    if (index >= request.inputs.size()) {
      return absl::InvalidArgumentError("malformed JSON: the inputs changed between reads");
    }
    const JsonInput& input = request.inputs[index++];
    if (!input.has_data) return absl::OkStatus();
    for (int slot = 0; slot < 4; ++slot) {
      if (found[slot].input != &input) continue;
      ondemand::value data;
      ATTNSERVE_JSON(item["data"].get(data), "data");
      found[slot].json = true;
      return ReadSlotData(data, slot, input, body_size, decoded);
    }
    return absl::OkStatus();
  });
}

HttpOutput Output(std::string name, bool binary) {
  HttpOutput output;
  output.name = std::move(name);
  output.binary = binary;
  return output;
}

// The reply's outputs: those named (each once, each one of ours), or `output` and, with
// return_attention, `attention`.
absl::Status ChooseOutputs(const JsonRequest& request, DecodedHttpInfer* decoded) {
  decoded->outputs.clear();
  if (request.outputs.empty()) {
    decoded->outputs.push_back(Output(kInferOutput, request.binary_output));
    if (request.return_attention) {
      decoded->outputs.push_back(Output(kInferAttention, request.binary_output));
    }
    return absl::OkStatus();
  }
  for (const auto& [name, binary] : request.outputs) {
    if (name != kInferOutput && name != kInferAttention) {
      return absl::InvalidArgumentError(absl::StrCat("requested output '", Clipped(name),
                                                     "' is not an output of the model (",
                                                     kInferOutput, ", ", kInferAttention, ")"));
    }
    for (const HttpOutput& chosen : decoded->outputs) {
      if (chosen.name == name) {
        return absl::InvalidArgumentError(absl::StrCat("output '", name, "' requested twice"));
      }
    }
    decoded->outputs.push_back(Output(name, binary.value_or(request.binary_output)));
  }
  return absl::OkStatus();
}

absl::Status ApplyParameters(const JsonRequest& request, DecodedHttpInfer* decoded) {
  core::ForwardArgs& args = decoded->args;
  args.kind = core::AttentionKind::kBidirectional;
  if (request.kind.has_value()) {
    const std::optional<core::AttentionKind> kind = core::KindFromName(*request.kind);
    if (!kind.has_value()) {
      std::vector<std::string> names;
      for (core::AttentionKind k : core::kAttentionKinds) names.emplace_back(core::KindName(k));
      return absl::InvalidArgumentError(absl::StrCat("parameter 'kind': unknown kind '",
                                                     Clipped(*request.kind), "'; one of ",
                                                     absl::StrJoin(names, ", ")));
    }
    args.kind = *kind;
  }
  if (absl::Status status = ChooseOutputs(request, decoded); !status.ok()) return status;
  args.return_attention =
      std::any_of(decoded->outputs.begin(), decoded->outputs.end(),
                  [](const HttpOutput& o) { return o.name == kInferAttention; });
  return absl::OkStatus();
}

// Decodes the tensors once the header is read.
absl::Status DecodeTensors(ondemand::document& document, absl::string_view binary, size_t body_size,
                           JsonRequest* request, DecodedHttpInfer* decoded) {
  InputData found[4];  // in kInputNames' order
  if (absl::Status status = AssignInputs(binary, request, found); !status.ok()) return status;
  absl::Status read = ReadJsonData(document, *request, body_size, found, decoded);
  if (!read.ok()) return read;
  auto& [input, lengths, context, context_lengths] = found;
  if (input.input == nullptr) return Invalid(kInferInput, "missing: the model needs it");
  core::ForwardArgs& args = decoded->args;
  absl::Status status = DecodeBatch(input, lengths.input != nullptr ? &lengths : nullptr,
                                    &decoded->input_copy, &decoded->lengths_copy, &args.input);
  if (!status.ok()) return status;
  if (context.input == nullptr) {
    if (context_lengths.input != nullptr) {
      return Invalid(kInferContextLengths, "given without a 'context' tensor");
    }
    args.context.reset();
    return absl::OkStatus();
  }
  args.context.emplace();
  return DecodeBatch(context, context_lengths.input != nullptr ? &context_lengths : nullptr,
                     &decoded->context_copy, &decoded->context_lengths_copy, &*args.context);
}

// Appends `value` as the shortest text that reads back as the same float.
void AppendFloat(float value, std::string* out) {
  char text[32];
  const auto [end, error] = std::to_chars(text, text + sizeof(text), value);
  out->append(text, end);
}

void AppendOutput(const HttpOutput& output, std::string* json) {
  *json += "{\"name\":";
  AppendJsonString(output.name, json);
  *json += ",\"datatype\":\"FP32\",\"shape\":[";
  *json += absl::StrJoin(output.shape, ",");
  *json += "]";
  if (output.binary) {
    absl::StrAppend(
        json, ",\"parameters\":{\"binary_data_size\":", output.values.size() * sizeof(float), "}}");
    return;
  }
  *json += ",\"data\":[";
  json->reserve(json->size() + output.values.size() * 12 + 3);
  for (size_t i = 0; i < output.values.size(); ++i) {
    if (i > 0) json->push_back(',');
    AppendFloat(output.values[i], json);
  }
  *json += "]}";
}

}  // namespace

absl::Status DecodeHttpInfer(absl::string_view body, size_t body_capacity, int64_t json_length,
                             DecodedHttpInfer* decoded) {
  if (json_length > static_cast<int64_t>(body.size())) {
    return absl::InvalidArgumentError(absl::StrCat("Inference-Header-Content-Length is ",
                                                   json_length, " for a body of ", body.size(),
                                                   " bytes"));
  }
  const absl::string_view json = json_length >= 0 ? body.substr(0, json_length) : body;
  const absl::string_view binary = json_length >= 0 ? body.substr(json_length) : "";
  // In place when the bytes after the JSON are ours to read; else a padded copy (the JSON
  // header of a binary request is small).
  simdjson::padded_string copy;
  simdjson::padded_string_view view;
  if (json_length < 0 && body_capacity >= body.size() + kJsonPadding) {
    view = simdjson::padded_string_view(body.data(), body.size(), body_capacity);
  } else {
    copy = simdjson::padded_string(json.data(), json.size());
    view = copy;
  }
  ondemand::parser parser;
  ondemand::document document;
  ATTNSERVE_JSON(parser.iterate(view).get(document), "the request");
  JsonRequest request;
  if (absl::Status status = ReadHeader(document, &request); !status.ok()) return status;
  if (document.current_location().error() == simdjson::SUCCESS) {
    return absl::InvalidArgumentError("malformed JSON: content after the request object");
  }
  decoded->id = request.id;
  decoded->kind_given = request.kind.has_value();
  decoded->sequence.reset();
  if (!request.sequence_id.has_value() && (request.sequence_start || request.sequence_end)) {
    return SequenceFlagWithoutId(request.sequence_start ? kSequenceStartParameter
                                                        : kSequenceEndParameter);
  }
  if (request.sequence_id.has_value()) {
    decoded->sequence =
        SequenceParams{*request.sequence_id, request.sequence_start, request.sequence_end};
  }
  if (absl::Status status = ApplyParameters(request, decoded); !status.ok()) return status;
  return DecodeTensors(document, binary, json.size(), &request, decoded);
}

int64_t HttpReplyBytes(const DecodedHttpInfer& decoded, const core::ForwardShapes& shapes) {
  int64_t bytes = 256 + static_cast<int64_t>(decoded.id.size()) * 6;
  for (const HttpOutput& output : decoded.outputs) {
    const int64_t count =
        output.name == kInferOutput ? shapes.output_size() : shapes.attention_size();
    // The longest float text is 15 characters ("-1.17549435e-38"), and a comma.
    bytes += count * (output.binary ? 4 : 16);
  }
  return bytes;
}

absl::StatusOr<ForwardBuffers> PrepareHttpOutputs(const core::ForwardShapes& shapes,
                                                  DecodedHttpInfer* decoded) {
  ForwardBuffers buffers;
  for (HttpOutput& output : decoded->outputs) {
    const bool is_output = output.name == kInferOutput;
    const int64_t count = is_output ? shapes.output_size() : shapes.attention_size();
    if (absl::Status status = CheckReplyFloats(count); !status.ok()) return status;
    output.shape = is_output ? OutputShape(decoded->args.input, shapes) : AttentionShape(shapes);
    output.values.assign(count, 0.0f);  // zero-filled: padded rows stay 0
    (is_output ? buffers.output : buffers.attention) = output.values;
  }
  if (buffers.output.empty()) {
    // Forward always writes the output; the caller asked only for the attention.
    decoded->output_scratch.assign(shapes.output_size(), 0.0f);
    buffers.output = decoded->output_scratch;
  }
  return buffers;
}

HttpInferReply EncodeHttpInfer(absl::string_view model, int64_t version,
                               const DecodedHttpInfer& decoded) {
  HttpInferReply reply;
  std::string& json = reply.json;
  json = "{\"model_name\":";
  AppendJsonString(model, &json);
  absl::StrAppend(&json, ",\"model_version\":\"", version, "\"");
  if (!decoded.id.empty()) {
    json += ",\"id\":";
    AppendJsonString(decoded.id, &json);
  }
  json += ",\"outputs\":[";
  for (size_t i = 0; i < decoded.outputs.size(); ++i) {
    const HttpOutput& output = decoded.outputs[i];
    if (i > 0) json += ",";
    AppendOutput(output, &json);
    if (output.binary) {
      reply.binary.emplace_back(reinterpret_cast<const char*>(output.values.data()),
                                output.values.size() * sizeof(float));
    }
  }
  json += "]}";
  return reply;
}

}  // namespace attnserve::server
