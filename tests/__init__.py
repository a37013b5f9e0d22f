"""stoker's tests."""
