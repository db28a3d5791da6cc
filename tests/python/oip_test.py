"""The Open Inference Protocol (inference.GRPCInferenceService) against a live server, with
stubs generated from proto/inference/grpc_service.proto, and once with a request whose bytes
are written here by hand from the specification's field numbers (and the answer decoded by
hand), so that a proto that drifted from the specification fails even where our own stubs
would agree with it.

usage: oip_test.py TARGET STUBS_DIR EXAMPLES_PYTHON_DIR
"""
import struct
import sys

import grpc
import numpy as np

sys.path.insert(0, sys.argv[2])
sys.path.insert(0, sys.argv[3])
from attnserve_client import reference_mha, reference_sdpa  # noqa: E402
from inference import grpc_service_pb2 as pb  # noqa: E402
from inference import grpc_service_pb2_grpc as pb_grpc  # noqa: E402

RNG = np.random.default_rng(11)
failures = []


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


def uniform(*shape):
    return RNG.uniform(-1, 1, shape).astype(np.float32)


def infer_request(model, tensors, raw=True, parameters=None, outputs=()):
    """tensors: (name, datatype, array); raw: bytes in raw_input_contents, else typed."""
    request = pb.ModelInferRequest(model_name=model, id="request-7")
    for name, datatype, array in tensors:
        tensor = request.inputs.add(name=name, datatype=datatype, shape=array.shape)
        if raw:
            request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
        elif datatype == "FP32":
            tensor.contents.fp32_contents.extend(array.ravel().tolist())
        elif datatype == "BOOL":
            tensor.contents.bool_contents.extend(array.ravel().tolist())
        elif datatype == "INT64":
            tensor.contents.int64_contents.extend(array.ravel().tolist())
    for key, value in (parameters or {}).items():
        parameter = request.parameters[key]
        if isinstance(value, bool):
            parameter.bool_param = value
        elif isinstance(value, float):
            parameter.double_param = value
        elif isinstance(value, int):
            parameter.int64_param = value
        else:
            parameter.string_param = value
    for name in outputs:
        request.outputs.add(name=name)
    return request


def outputs_of(response):
    dtypes = {"FP32": np.float32, "FP16": np.float16}
    result = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents):
        if tensor.datatype == "BF16":
            bits = np.frombuffer(raw, np.uint16).astype(np.uint32) << 16
            array = bits.view(np.float32)
        else:
            array = np.frombuffer(raw, dtypes[tensor.datatype])
        result[tensor.name] = array.reshape(tuple(tensor.shape))
    return result


def expect_error(name, call, code, *texts):
    try:
        call()
        check(name, False, "the call succeeded")
    except grpc.RpcError as error:
        ok = error.code() == code and all(text in error.details() for text in texts)
        check(name, ok, f"{error.code().name}: {error.details()}")


# ---- A request written by hand from the specification ----------------------------------------

def varint(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number, payload):
    """A length-delimited field (wire type 2)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def decode(message):
    """{field number: [values]} of one message: varints as ints, length-delimited as bytes."""
    fields, at = {}, 0
    while at < len(message):
        key, at = read_varint(message, at)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, at = read_varint(message, at)
        elif wire_type == 2:
            length, at = read_varint(message, at)
            value, at = message[at:at + length], at + length
        else:
            raise ValueError(f"wire type {wire_type}")
        fields.setdefault(number, []).append(value)
    return fields


def read_varint(data, at):
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, at


def hand_built_infer(channel):
    """ModelInferRequest, from the specification: model_name = 1, id = 3, parameters = 4
    (map<string, InferParameter>, bool_param = 1), inputs = 5 (InferInputTensor: name = 1,
    datatype = 2, shape = 3), outputs = 6 (name = 1), raw_input_contents = 7."""
    q, k, v = uniform(1, 1, 2, 4), uniform(1, 1, 3, 4), uniform(1, 1, 3, 4)
    message = field(1, b"sdpa") + field(3, b"by-hand")
    message += field(4, field(1, b"causal") + field(2, varint(1 << 3 | 0) + varint(1)))
    for name, array in (("QUERY", q), ("KEY", k), ("VALUE", v)):
        shape = b"".join(varint(dim) for dim in array.shape)
        message += field(5, field(1, name.encode()) + field(2, b"FP32") + field(3, shape))
    message += field(6, field(1, b"OUTPUT"))
    for array in (q, k, v):
        message += field(7, array.tobytes())
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                request_serializer=lambda raw: raw,
                                response_deserializer=lambda raw: raw)
    answer = decode(infer(message, timeout=30))
    # ModelInferResponse: model_name = 1, model_version = 2, id = 3, outputs = 5
    # (InferOutputTensor: name = 1, datatype = 2, shape = 3), raw_output_contents = 6.
    output = decode(answer[5][0])
    packed = output[3][0]
    shape, at = [], 0
    while at < len(packed):
        dim, at = read_varint(packed, at)
        shape.append(dim)
    values = np.frombuffer(answer[6][0], np.float32).reshape(shape)
    expected = reference_sdpa(q, k, v, causal=True)
    ok = (answer[1] == [b"sdpa"] and answer[2] == [b"1"] and answer[3] == [b"by-hand"]
          and output[1] == [b"OUTPUT"] and output[2] == [b"FP32"] and shape == [1, 1, 2, 4]
          and np.abs(values - expected).max() < 1e-5)
    check("hand_built_model_infer", ok, f"shape {shape} max_abs_err "
          f"{np.abs(values - expected).max():.2e}")


def main():
    channel = grpc.insecure_channel(sys.argv[1], options=[
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20)])
    stub = pb_grpc.GRPCInferenceServiceStub(channel)

    check("server_live", stub.ServerLive(pb.ServerLiveRequest()).live)
    check("server_ready", stub.ServerReady(pb.ServerReadyRequest()).ready)
    metadata = stub.ServerMetadata(pb.ServerMetadataRequest())
    check("server_metadata", metadata.name == "attnserve" and metadata.version
          and {"model_configuration", "statistics"} <= set(metadata.extensions),
          f"{metadata.name} {metadata.version} {list(metadata.extensions)}")
    ready = [stub.ModelReady(pb.ModelReadyRequest(name=name, version=version)).ready
             for name, version in (("sdpa", ""), ("sdpa", "1"), ("demo", ""), ("sdpa", "2"),
                                   ("nothing", ""))]
    check("model_ready", ready == [True, True, True, False, False], str(ready))
    sdpa = stub.ModelMetadata(pb.ModelMetadataRequest(name="sdpa"))
    check("model_metadata_sdpa",
          [t.name for t in sdpa.inputs] == ["QUERY", "KEY", "VALUE", "ATTN_MASK", "KEY_LENGTHS"]
          and [t.name for t in sdpa.outputs] == ["OUTPUT", "LSE", "WEIGHTS"]
          and list(sdpa.versions) == ["1"], str(sdpa.inputs[0]).replace("\n", " "))
    demo = stub.ModelMetadata(pb.ModelMetadataRequest(name="demo"))
    check("model_metadata_weight_set", list(demo.inputs[0].shape) == [-1, -1, 64]
          and demo.versions[0].isdigit(), f"{list(demo.inputs[0].shape)} {demo.versions}")
    expect_error("model_metadata_unknown",
                 lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name="nothing")),
                 grpc.StatusCode.NOT_FOUND, "nothing")
    config = stub.ModelConfig(pb.ModelConfigRequest(name="sdpa")).config
    check("model_config", config.name == "sdpa" and config.max_batch_size == 0
          and [i.name for i in config.input][:3] == ["QUERY", "KEY", "VALUE"]
          and config.input[0].data_type == pb.TYPE_FP32
          and config.input[3].data_type == pb.TYPE_BOOL and config.input[3].optional
          and [o.name for o in config.output] == ["OUTPUT", "LSE", "WEIGHTS"],
          f"{config.platform} {config.backend}")

    # sdpa, raw and typed contents, with every input and the options as parameters.
    q, k, v = uniform(2, 4, 5, 8), uniform(2, 2, 7, 8), uniform(2, 2, 7, 8)
    mask = RNG.uniform(size=(2, 1, 5, 7)) < 0.8
    mask[..., 0] = True
    lengths = np.array([7, 4], np.int64)
    options = dict(causal=True, causal_alignment="BOTTOM_RIGHT", key_lengths=lengths,
                   attn_mask=mask, scale=0.4)
    expected = reference_sdpa(q, k, v, **options)
    for raw in (True, False):
        request = infer_request("sdpa", [("QUERY", "FP32", q), ("KEY", "FP32", k),
                                         ("VALUE", "FP32", v), ("ATTN_MASK", "BOOL", mask),
                                         ("KEY_LENGTHS", "INT64", lengths)], raw=raw,
                                parameters={"causal": True,
                                            "causal_alignment": "bottom_right",
                                            "scale": 0.4, "return_lse": True})
        response = stub.ModelInfer(request)
        out = outputs_of(response)
        error = np.abs(out["OUTPUT"] - expected).max()
        check(f"infer_sdpa_{'raw' if raw else 'typed'}",
              set(out) == {"OUTPUT", "LSE"} and out["LSE"].shape == (2, 4, 5)
              and error < 1e-5 and response.id == "request-7"
              and response.model_version == "1", f"max_abs_err {error:.2e}")

    # The attention variants as parameters: a causal window of 2 keys back, one sink, a
    # softcap; against NumPy written here.
    scores = np.einsum("bhid,bhjd->bhij", q.astype(np.float64),
                       np.repeat(k, 2, axis=1).astype(np.float64)) / np.sqrt(8)
    scores = 5.0 * np.tanh(scores / 5.0)
    i, j = np.arange(5)[:, None], np.arange(7)[None, :]
    seen = (j <= i) & ((j >= i - 2) | (j < 1))
    scores = np.where(seen, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("bhij,bhjd->bhid", weights / weights.sum(-1, keepdims=True),
                         np.repeat(v, 2, axis=1))
    response = stub.ModelInfer(infer_request(
        "sdpa", [("QUERY", "FP32", q), ("KEY", "FP32", k), ("VALUE", "FP32", v)],
        parameters={"causal": True, "window_left": 2, "num_sink_tokens": 1, "softcap": 5.0}))
    error = np.abs(outputs_of(response)["OUTPUT"] - expected).max()
    check("infer_sdpa_window_sinks_softcap", error < 1e-5, f"max_abs_err {error:.2e}")
    expect_error("infer_bad_window_kind", lambda: stub.ModelInfer(infer_request(
        "sdpa", [("QUERY", "FP32", q), ("KEY", "FP32", k), ("VALUE", "FP32", v)],
        parameters={"window_left": "two"})), grpc.StatusCode.INVALID_ARGUMENT,
        "window_left")

    # FP16 and BF16 travel raw; WEIGHTS asked as an output.
    half = [a.astype(np.float16) for a in (q, k, v)]
    response = stub.ModelInfer(infer_request(
        "sdpa", [("QUERY", "FP16", half[0]), ("KEY", "FP16", half[1]),
                 ("VALUE", "FP16", half[2])], outputs=("OUTPUT", "WEIGHTS")))
    out = outputs_of(response)
    error = np.abs(out["OUTPUT"].astype(np.float64) - reference_sdpa(*half)).max()
    check("infer_sdpa_fp16_weights", response.outputs[0].datatype == "FP16"
          and out["WEIGHTS"].shape == (2, 4, 5, 7) and error < 2e-3, f"{error:.2e}")
    bits = [(a.view(np.uint32) >> 16).astype(np.uint16) for a in (q, k, v)]
    response = stub.ModelInfer(infer_request(
        "sdpa", [("QUERY", "BF16", bits[0]), ("KEY", "BF16", bits[1]),
                 ("VALUE", "BF16", bits[2])], parameters={"output_dtype": "FP32"}))
    widened = [(b.astype(np.uint32) << 16).view(np.float32) for b in bits]
    error = np.abs(outputs_of(response)["OUTPUT"] - reference_sdpa(*widened)).max()
    check("infer_sdpa_bf16", response.outputs[0].datatype == "FP32" and error < 1e-5,
          f"{error:.2e}")

    # As KServe's Python SDK sends NumPy inputs: each with its binary_data_size, and an
    # output asked for with binary_data.
    request = infer_request("sdpa", [("QUERY", "FP32", q), ("KEY", "FP32", k),
                                     ("VALUE", "FP32", v)], outputs=("OUTPUT",))
    for tensor, contents in zip(request.inputs, request.raw_input_contents):
        tensor.parameters["binary_data_size"].int64_param = len(contents)
    request.outputs[0].parameters["binary_data"].bool_param = True
    error = np.abs(outputs_of(stub.ModelInfer(request))["OUTPUT"]
                   - reference_sdpa(q, k, v)).max()
    check("infer_sdpa_kserve_sdk_parameters", error < 1e-5, f"{error:.2e}")
    request.inputs[2].parameters["binary_data_size"].int64_param += 1
    expect_error("infer_binary_data_size_wrong", lambda: stub.ModelInfer(request),
                 grpc.StatusCode.INVALID_ARGUMENT, "binary_data_size")

    # A weight set is a model: the demo set, at its version.
    version = demo.versions[0]
    x = uniform(2, 3, 64)
    response = stub.ModelInfer(infer_request("demo", [("INPUT", "FP32", x)], raw=False))
    check("infer_weight_set", response.model_version == version
          and outputs_of(response)["OUTPUT"].shape == (2, 3, 64),
          f"version {response.model_version}")

    # Errors name the input or parameter, with the protocol's codes.
    good = [("QUERY", "FP32", q), ("KEY", "FP32", k), ("VALUE", "FP32", v)]
    expect_error("error_unknown_model", lambda: stub.ModelInfer(infer_request("nothing", good)),
                 grpc.StatusCode.NOT_FOUND, "nothing")
    expect_error("error_shape", lambda: stub.ModelInfer(infer_request(
        "sdpa", [good[0], ("KEY", "FP32", uniform(2, 2, 7, 16)), good[2]])),
        grpc.StatusCode.INVALID_ARGUMENT, "KEY.shape[3] (Dk)")
    expect_error("error_missing_input", lambda: stub.ModelInfer(infer_request("sdpa", good[:2])),
                 grpc.StatusCode.INVALID_ARGUMENT, "input VALUE is missing")
    expect_error("error_unknown_input", lambda: stub.ModelInfer(infer_request(
        "sdpa", good + [("BIAS", "FP32", q)])), grpc.StatusCode.INVALID_ARGUMENT, "BIAS")
    expect_error("error_datatype", lambda: stub.ModelInfer(infer_request(
        "sdpa", [("QUERY", "INT64", q.astype(np.int64))] + good[1:])),
        grpc.StatusCode.INVALID_ARGUMENT, "input QUERY is", "expected one of FP32")
    # An empty KEY_LENGTHS would read as none at all.
    expect_error("error_empty_key_lengths", lambda: stub.ModelInfer(infer_request(
        "sdpa", good + [("KEY_LENGTHS", "INT64", np.zeros(0, np.int64))])),
        grpc.StatusCode.INVALID_ARGUMENT, "input KEY_LENGTHS has shape [0], expected [B]")
    request = infer_request("sdpa", good)
    request.raw_input_contents.pop()
    expect_error("error_raw_count", lambda: stub.ModelInfer(request),
                 grpc.StatusCode.INVALID_ARGUMENT, "raw_input_contents holds 2 entries")
    expect_error("error_parameter_kind", lambda: stub.ModelInfer(infer_request(
        "sdpa", good, parameters={"causal": "yes"})), grpc.StatusCode.INVALID_ARGUMENT,
        "parameter causal is a string, expected a bool")
    expect_error("error_parameter_unknown", lambda: stub.ModelInfer(infer_request(
        "sdpa", good, parameters={"casual": True})), grpc.StatusCode.INVALID_ARGUMENT,
        "casual")
    expect_error("error_weight_set_version", lambda: stub.ModelInfer(infer_request(
        "demo", [("INPUT", "FP32", x)]).__class__(model_name="demo", model_version="999")),
        grpc.StatusCode.NOT_FOUND, "999")

    stats = {s.name: s for s in
             stub.ModelStatistics(pb.ModelStatisticsRequest()).model_stats}
    sdpa_stats = stats["sdpa"].inference_stats
    check("model_statistics", stats["sdpa"].inference_count >= 4
          and sdpa_stats.success.count == stats["sdpa"].inference_count
          and sdpa_stats.fail.count >= 7 and sdpa_stats.compute_infer.count >= 4
          and stats["demo"].inference_count >= 1,
          f"sdpa {stats['sdpa'].inference_count} ok, {sdpa_stats.fail.count} failed")

    hand_built_infer(channel)
    print(f"{len(failures)} checks failed" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
