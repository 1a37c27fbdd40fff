"""OpenTelemetry traces of the engine's requests (--otlp-traces-endpoint).

Imported only when that flag is given: the SDK is the optional extra `otel`
(`pip install 'cadence[otel]'`). export.py sends spans out of the process; spans.py makes
them from the engine's reports, the same records its log lines are written from.
"""
