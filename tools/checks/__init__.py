"""The maintainers' checks: planted mistakes, a second implementation, the pages' commands and words."""
