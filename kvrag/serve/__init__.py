"""``kvrag serve``: answering many clients at once from one model.

``kvrag.serve.scheduler`` holds the request scheduler (admission, prefill through the library's
query path, decode steps shared by the running requests). Nothing is imported here: ``import
kvrag`` never imports this package, and importing the package imports no web framework.
"""
