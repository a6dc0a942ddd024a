"""The OpenAI-compatible HTTP front end over the Triton deployment (`python -m eagle_trt.serve`):
`app.py` the Starlette app, `protocol.py` request validation and OpenAI's error object,
`triton_stream.py` one request over Triton's gRPC stream, `metrics.py` the Prometheus metrics."""
