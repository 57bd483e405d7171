"""``kvrag serve``: answering many clients at once from one model.

``kvrag.serve.scheduler`` holds the request scheduler (admission, prefill through the library's
query path, decode steps shared by the running requests); ``app`` the HTTP server on it
(``create_app``: OpenAI's wire format, FastAPI; routes and error handlers), ``serving`` /
``serving_chat`` / ``serving_completion`` / ``serving_chunks`` the work of each endpoint family,
``protocol`` the request/response models, ``middleware`` the body limit, counting, admission
and API key, ``lifecycle`` the server's state (readiness, drain), ``metrics`` its Prometheus
metrics. Nothing is imported here: ``import kvrag`` never imports this package,
and importing the package imports no web framework.
"""
