"""Where the tests' own files live, for test modules at any depth of tests/."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
DATA = TESTS / "data"
FIXTURES = TESTS / "fixtures"
SUPPORT = TESTS / "support"
ARCH_DATA = DATA / "arch"
