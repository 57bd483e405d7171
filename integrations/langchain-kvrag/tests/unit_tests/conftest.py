"""LangChain's rule for a partner package's unit tests: no network. Every test here runs with
TCP/UDP sockets disabled (pytest-socket; Unix sockets stay allowed for asyncio's event loop)."""

from pytest_socket import disable_socket


def pytest_runtest_setup(item):
    # Before the item's fixtures are set up; pytest-socket's teardown enables sockets again.
    disable_socket(allow_unix_socket=True)
