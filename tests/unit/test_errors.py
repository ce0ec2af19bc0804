"""One exception root per package: every public exception a package defines derives from
its root, and every root from EnrichqError."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from enrichq_parity.errors import ParityError
from enrichq_schema.errors import EnrichqError
from enrichq_service.errors import ServiceError
from enrichq_sweeper.errors import SweeperError

ROOTS: dict[str, type[Exception]] = {
    "enrichq_schema": EnrichqError,
    "enrichq_service": ServiceError,
    "enrichq_sweeper": SweeperError,
    "enrichq_parity": ParityError,
}


def extends_a_library(cls: type[BaseException]) -> bool:
    """Whether `cls` extends another library's exception, to be raised inside that library
    (`pooling.NoReply` is a psycopg error so that SQLAlchemy treats it as one)."""
    return any(
        base.__module__ != "builtins" and not base.__module__.startswith("enrichq_")
        for base in cls.__mro__
    )


def defined_exceptions(package: str) -> list[type[BaseException]]:
    """The public exception classes the modules of `package` define (not import), except
    those that extend another library's exception."""
    found = []
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, f"{package}."):
        if ".migrations" in info.name or info.name.endswith(".__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == info.name
                and not name.startswith("_")
                and not extends_a_library(value)
            ):
                found.append(value)
    return found


@pytest.mark.parametrize("package", ROOTS)
def test_every_public_exception_derives_from_its_package_root(package: str) -> None:
    strays = [
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in defined_exceptions(package)
        if not issubclass(cls, ROOTS[package])
    ]
    assert strays == []


def test_every_root_derives_from_enrichq_error() -> None:
    assert all(issubclass(root, EnrichqError) for root in ROOTS.values())
