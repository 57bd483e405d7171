"""``kvrag serve``: answering many clients at once from one model.

``kvrag.serve.scheduler`` holds the request scheduler (admission, prefill through the library's
query path, decode steps shared by the running requests); ``app`` the HTTP server on it
(``create_app``: OpenAI's wire format, FastAPI), ``protocol`` its request/response models,
``metrics`` its Prometheus metrics, ``client`` the chunk-ingestion client the framework hooks
use with ``server=``. Nothing is imported here: ``import kvrag`` never imports this package,
and importing the package imports no web framework.
"""
