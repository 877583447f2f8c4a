// json_bench: why the REST port parses JSON as it does (docs/open-inference-protocol.md).
// 1. A ~1.2 MB Open Inference Protocol JSON tensor parsed into a std::vector<float> by each
//    candidate parser from Debian: nlohmann (DOM), RapidJSON (DOM and SAX), simdjson (on-demand).
// 2. The REST frontend's decode (DecodeHttpInfer: JSON straight into the call's float vector)
//    against the other route, JSON into a ModelInferRequest (fp32_contents) then the gRPC
//    codec's DecodeInferRequest; for 1x16x256 and 1x384x256, JSON and binary.
// Medians of 21 runs; run by hand: build/tests/bench/json_bench
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "inference/grpc_service.pb.h"
#include "nlohmann/json.hpp"
#include "rapidjson/document.h"
#include "rapidjson/reader.h"
#include "server/frontends/http/infer_json.h"
#include "server/frontends/oip/infer_codec.h"
#include "simdjson.h"

namespace {
std::string MakeBody(int count) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::string body = "{\"inputs\":[{\"name\":\"input\",\"datatype\":\"FP32\",\"shape\":[1," +
                     std::to_string(count / 256) + ",256],\"data\":[";
  char buf[32];
  for (int i = 0; i < count; ++i) {
    snprintf(buf, sizeof buf, i ? ",%.9g" : "%.9g", normal(rng));
    body += buf;
  }
  return body + "]}]}";
}

template <typename F>
double MedianMs(F&& f) {
  std::vector<double> times;
  for (int i = 0; i < 21; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    times.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

struct FloatsHandler : rapidjson::BaseReaderHandler<rapidjson::UTF8<>, FloatsHandler> {
  std::vector<float>* out;
  bool Double(double d) {
    out->push_back(static_cast<float>(d));
    return true;
  }
  bool Int(int i) {
    out->push_back(i);
    return true;
  }
  bool Uint(unsigned i) {
    out->push_back(i);
    return true;
  }
  bool Int64(int64_t i) {
    out->push_back(i);
    return true;
  }
  bool Uint64(uint64_t i) {
    out->push_back(i);
    return true;
  }
  bool Default() { return true; }
};
}  // namespace

// The other route: JSON parsed into a ModelInferRequest (what a gRPC-shaped REST frontend
// would build), then the gRPC codec.
void ViaModelInferRequest(const std::string& body, const std::string& binary, int64_t json_length) {
  simdjson::ondemand::parser parser;
  simdjson::padded_string padded(body.data(), json_length >= 0 ? json_length : body.size());
  auto doc = parser.iterate(padded);
  inference::ModelInferRequest request;
  request.set_model_name("demo");
  auto input_json = doc["inputs"].at(0);
  auto* input = request.add_inputs();
  input->set_name("input");
  input->set_datatype("FP32");
  for (int64_t dim : input_json["shape"].get_array()) input->add_shape(dim);
  if (json_length >= 0) {
    request.add_raw_input_contents(binary);
  } else {
    auto* values = input->mutable_contents()->mutable_fp32_contents();
    for (double v : input_json["data"].get_array()) values->Add(static_cast<float>(v));
  }
  attnserve::server::DecodedInfer decoded;
  if (!attnserve::server::DecodeInferRequest(request, &decoded).ok()) std::abort();
}

void CompareRoutes(int seq) {
  const int count = seq * 256;
  std::string json = MakeBody(count);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> x(count);
  for (float& v : x) v = normal(rng);
  const std::string binary(reinterpret_cast<const char*>(x.data()), x.size() * 4);
  const std::string header =
      "{\"inputs\":[{\"name\":\"input\",\"datatype\":\"FP32\",\"shape\":[1," + std::to_string(seq) +
      ",256],\"parameters\":{\"binary_data_size\":" + std::to_string(binary.size()) + "}}]}";
  const std::string binary_body = header + binary;
  std::string padded_json = json;
  padded_json.reserve(json.size() + attnserve::server::kJsonPadding);
  const double direct_json = MedianMs([&] {
    attnserve::server::DecodedHttpInfer decoded;
    if (!attnserve::server::DecodeHttpInfer(padded_json, padded_json.capacity(), -1, &decoded).ok())
      std::abort();
  });
  const double proto_json = MedianMs([&] { ViaModelInferRequest(json, "", -1); });
  const double direct_binary = MedianMs([&] {
    attnserve::server::DecodedHttpInfer decoded;
    if (!attnserve::server::DecodeHttpInfer(binary_body, binary_body.size(), header.size(),
                                            &decoded)
             .ok())
      std::abort();
  });
  const double proto_binary =
      MedianMs([&] { ViaModelInferRequest(header, binary, header.size()); });
  printf("1x%-4d JSON:   direct %8.1f us   via ModelInferRequest %8.1f us   (%.2fx)\n", seq,
         direct_json * 1e3, proto_json * 1e3, proto_json / direct_json);
  printf("1x%-4d binary: direct %8.1f us   via ModelInferRequest %8.1f us   (%.2fx)\n", seq,
         direct_binary * 1e3, proto_binary * 1e3, proto_binary / direct_binary);
}

int main() {
  const int count = 256 * 384;  // 98,304 floats
  const std::string body = MakeBody(count);
  std::vector<float> out;
  out.reserve(count);
  double check[4] = {};
  const double nl = MedianMs([&] {
    out.clear();
    auto doc = nlohmann::json::parse(body);
    for (const auto& v : doc["inputs"][0]["data"]) out.push_back(v.get<float>());
    check[0] = out.back();
  });
  const double rj_dom = MedianMs([&] {
    out.clear();
    rapidjson::Document doc;
    doc.Parse<rapidjson::kParseFullPrecisionFlag>(body.data(), body.size());
    for (const auto& v : doc["inputs"][0]["data"].GetArray()) out.push_back(v.GetFloat());
    check[1] = out.back();
  });
  const double rj_sax = MedianMs([&] {
    out.clear();
    FloatsHandler handler;
    handler.out = &out;
    rapidjson::Reader reader;
    rapidjson::MemoryStream stream(body.data(), body.size());
    reader.Parse<rapidjson::kParseFullPrecisionFlag>(stream, handler);
    check[2] = out.back();
  });
  simdjson::ondemand::parser parser;
  simdjson::padded_string padded(body);
  const double sj = MedianMs([&] {
    out.clear();
    auto doc = parser.iterate(padded);
    for (double v : doc["inputs"].at(0)["data"].get_array()) out.push_back(static_cast<float>(v));
    check[3] = out.back();
  });
  printf("body %.2f MB, %d floats; last value agrees: %d\n", body.size() / 1e6, count,
         check[0] == check[1] && check[1] == check[2] && check[2] == check[3]);
  printf("%-28s %8s %8s %10s\n", "parser", "ms", "MB/s", "vs simdjson");
  auto row = [&](const char* name, double ms) {
    printf("%-28s %8.2f %8.0f %9.1fx\n", name, ms, body.size() / 1e3 / ms, ms / sj);
  };
  row("nlohmann::json DOM", nl);
  row("RapidJSON DOM (full prec.)", rj_dom);
  row("RapidJSON SAX (full prec.)", rj_sax);
  row("simdjson 3.0 on-demand", sj);
  printf("\nthe REST decode against a ModelInferRequest in between:\n");
  CompareRoutes(16);
  CompareRoutes(384);
}
