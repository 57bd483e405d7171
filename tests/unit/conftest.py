"""Unit tests: tiny random-weight models, no network. Every test here runs with TCP/UDP
sockets disabled (pytest-socket; Unix sockets stay allowed: asyncio's event loop and
multiprocessing use them), as LangChain runs its unit tests: a test that needs a server
belongs in tests/integration."""

from pytest_socket import disable_socket


def pytest_runtest_setup(item):
    # Runs before the item's fixtures are set up, so module fixtures are built offline too;
    # pytest-socket's own teardown hook enables sockets again after each test.
    disable_socket(allow_unix_socket=True)
