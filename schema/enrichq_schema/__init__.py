"""enrichq's schema: table metadata, migrations, states, database access and the SQL loader."""
