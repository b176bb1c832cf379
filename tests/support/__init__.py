"""Helpers the tests import (one set for the whole suite); fixtures stay in the conftest files."""
