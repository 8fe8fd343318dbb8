"""The tests of the command line, the design reviews, the pages, the quiz and the hints (course/)."""
