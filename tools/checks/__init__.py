"""The maintainers' checks of the suite: planted mistakes, where their blame lands, what a student
reads first, a second implementation, each exercise stubbed alone."""
