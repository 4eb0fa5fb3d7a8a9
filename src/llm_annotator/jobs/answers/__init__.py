"""What comes back: an answer checked against its schema and made the record stored."""
