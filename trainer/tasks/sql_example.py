"""A small text-to-SQL dataset in Spider's layout, written from code (no download needed).

Three SQLite databases modelled on Spider's ``concert_singer``, ``pets_1`` and ``employee_hire_evaluation``,
with questions and gold SQL in Spider's style (joins, nesting, INTERSECT/EXCEPT, GROUP BY/HAVING).
The tests build it in a temporary folder; ``python -m trainer.tasks.sql_example OUT`` writes it for
trying the ``spider`` task end to end.

Over 400 lines on purpose: most of them are the example data itself (tables, rows, and
questions with their gold SQL); the code that writes it is the last seventy lines.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

# table -> (columns as (name, type), primary key, foreign keys as (column, table, column), rows)
DATABASES: dict[str, dict[str, tuple]] = {
    "concert_singer": {
        "stadium": (
            [
                ("Stadium_ID", "number"),
                ("Location", "text"),
                ("Name", "text"),
                ("Capacity", "number"),
                ("Average", "number"),
            ],
            "Stadium_ID",
            [],
            [
                (1, "Raith Rovers", "Stark's Park", 10104, 2106),
                (2, "Ayr United", "Somerset Park", 11998, 1477),
                (3, "East Fife", "Bayview Stadium", 2000, 864),
                (4, "Queen's Park", "Hampden Park", 52500, 730),
                (5, "Stirling Albion", "Forthbank Stadium", 3808, 642),
                (6, "Arbroath", "Gayfield Park", 6000, 638),
                (7, "Alloa Athletic", "Recreation Park", 3100, 637),
                (9, "Peterhead", "Balmoor", 8000, 615),
                (10, "Brechin City", "Glebe Park", 3960, 552),
            ],
        ),
        "singer": (
            [
                ("Singer_ID", "number"),
                ("Name", "text"),
                ("Country", "text"),
                ("Song_Name", "text"),
                ("Song_release_year", "text"),
                ("Age", "number"),
                ("Is_male", "text"),
            ],
            "Singer_ID",
            [],
            [
                (1, "Joe Sharp", "Netherlands", "You", "1992", 52, "F"),
                (2, "Timbaland", "United States", "Dangerous", "2008", 32, "T"),
                (3, "Justin Brown", "France", "Hey Oh", "2013", 29, "T"),
                (4, "Rose White", "France", "Sun", "2003", 41, "F"),
                (5, "John Nizinik", "France", "Gentleman", "2014", 43, "T"),
                (6, "Tribal King", "France", "Love", "2016", 25, "T"),
            ],
        ),
        "concert": (
            [
                ("concert_ID", "number"),
                ("concert_Name", "text"),
                ("Theme", "text"),
                ("Stadium_ID", "number"),
                ("Year", "number"),
            ],
            "concert_ID",
            [("Stadium_ID", "stadium", "Stadium_ID")],
            [
                (1, "Auditions", "Free choice", 1, 2014),
                (2, "Super bootcamp", "Free choice 2", 2, 2014),
                (3, "Home Visits", "Bleeding Love", 2, 2015),
                (4, "Week 1", "Wide Awake", 10, 2014),
                (5, "Week 1", "Happy Tonight", 9, 2015),
                (6, "Week 2", "Party All Night", 7, 2013),
            ],
        ),
        "singer_in_concert": (
            [("concert_ID", "number"), ("Singer_ID", "number")],
            None,
            [("concert_ID", "concert", "concert_ID"), ("Singer_ID", "singer", "Singer_ID")],
            [(1, 2), (1, 3), (1, 5), (2, 3), (2, 6), (3, 5), (4, 4), (5, 6), (5, 3), (6, 2)],
        ),
    },
    "pets_1": {
        "Student": (
            [
                ("StuID", "number"),
                ("LName", "text"),
                ("Fname", "text"),
                ("Age", "number"),
                ("Sex", "text"),
                ("Major", "number"),
                ("Advisor", "number"),
                ("city_code", "text"),
            ],
            "StuID",
            [],
            [
                (1001, "Smith", "Linda", 18, "F", 600, 1121, "BAL"),
                (1002, "Kim", "Tracy", 19, "F", 600, 7712, "HKG"),
                (1003, "Jones", "Shiela", 21, "F", 600, 7792, "WAS"),
                (1004, "Kumar", "Dinesh", 20, "M", 600, 8423, "CHI"),
                (1005, "Gompers", "Paul", 26, "M", 520, 1121, "YYZ"),
                (1006, "Schultz", "Andy", 18, "M", 520, 1148, "BAL"),
                (1007, "Apap", "Lisa", 22, "F", 540, 8918, "PIT"),
                (1008, "Nelson", "Jandy", 20, "F", 600, 9172, "BAL"),
            ],
        ),
        "Has_Pet": (
            [("StuID", "number"), ("PetID", "number")],
            None,
            [("StuID", "Student", "StuID"), ("PetID", "Pets", "PetID")],
            [(1001, 2001), (1002, 2002), (1002, 2003), (1007, 2004)],
        ),
        "Pets": (
            [("PetID", "number"), ("PetType", "text"), ("pet_age", "number"), ("weight", "number")],
            "PetID",
            [],
            [(2001, "cat", 3, 12.0), (2002, "dog", 2, 13.4), (2003, "dog", 1, 9.3), (2004, "cat", 5, 8.0)],
        ),
    },
    "employee_hire_evaluation": {
        "employee": (
            [("Employee_ID", "number"), ("Name", "text"), ("Age", "number"), ("City", "text")],
            "Employee_ID",
            [],
            [
                (1, "George Chuter", 23, "Bristol"),
                (2, "Lee Mears", 29, "Bath"),
                (3, "Mark Regan", 43, "Bristol"),
                (4, "Jason Hobson", 30, "Bristol"),
                (5, "Tim Payne", 28, "Wasps"),
                (6, "Andrew Sheridan", 33, "Sale"),
                (7, "Matt Stevens", 31, "Bath"),
                (8, "Phil Vickery", 27, "Wasps"),
            ],
        ),
        "shop": (
            [
                ("Shop_ID", "number"),
                ("Name", "text"),
                ("Location", "text"),
                ("District", "text"),
                ("Number_products", "number"),
                ("Manager_name", "text"),
            ],
            "Shop_ID",
            [],
            [
                (1, "FC Haka", "Valkeakoski", "Tehtaan kenttä", 3516, "Olli Huttunen"),
                (2, "HJK", "Helsinki", "Finnair Stadium", 10770, "Antti Muurinen"),
                (3, "FC Honka", "Espoo", "Tapiolan Urheilupuisto", 2000, "Mika Lehkosuo"),
                (4, "FC Inter", "Turku", "Veritas Stadion", 10000, "Job Dragtsma"),
                (5, "FF Jaro", "Jakobstad", "Jakobstads Centralplan", 5000, "Mika Laurikainen"),
                (6, "FC KooTeePee", "Kotka", "Arto Tolsa Areena", 4780, "Tommi Kautonen"),
                (7, "FC Lahti", "Helsinki", "Finnair Stadium", 1500, "Ilkka Mäkelä"),
            ],
        ),
        "hiring": (
            [
                ("Shop_ID", "number"),
                ("Employee_ID", "number"),
                ("Start_from", "text"),
                ("Is_full_time", "text"),
            ],
            "Employee_ID",
            [("Shop_ID", "shop", "Shop_ID"), ("Employee_ID", "employee", "Employee_ID")],
            [
                (1, 1, "2009", "T"),
                (1, 2, "2003", "T"),
                (3, 3, "2011", "F"),
                (4, 4, "2012", "T"),
                (5, 5, "2013", "T"),
                (2, 6, "2010", "F"),
                (6, 7, "2008", "F"),
            ],
        ),
        "evaluation": (
            [("Employee_ID", "number"), ("Year_awarded", "text"), ("Bonus", "number")],
            None,
            [("Employee_ID", "employee", "Employee_ID")],
            [
                (1, "2011", 3000.0),
                (2, "2015", 3200.0),
                (1, "2016", 2900.0),
                (4, "2017", 3300.0),
                (7, "2018", 4000.0),
                (1, "2018", 3100.0),
            ],
        ),
    },
}

# (db_id, question, gold query) in Spider's style; the last few form the train split.
QUESTIONS: list[tuple[str, str, str]] = [
    ("concert_singer", "How many singers do we have?", "SELECT count(*) FROM singer"),
    (
        "concert_singer",
        "Show name, country, age for all singers ordered by age from the oldest to the youngest.",
        "SELECT name , country , age FROM singer ORDER BY age DESC",
    ),
    (
        "concert_singer",
        "What is the average, minimum, and maximum age of all singers from France?",
        "SELECT avg(age) , min(age) , max(age) FROM singer WHERE country = 'France'",
    ),
    (
        "concert_singer",
        "Show the name and the release year of the song by the youngest singer.",
        "SELECT song_name , song_release_year FROM singer ORDER BY age LIMIT 1",
    ),
    (
        "concert_singer",
        "What are all distinct countries where singers above age 20 are from?",
        "SELECT DISTINCT country FROM singer WHERE age > 20",
    ),
    (
        "concert_singer",
        "Show all countries and the number of singers in each country.",
        "SELECT country , count(*) FROM singer GROUP BY country",
    ),
    (
        "concert_singer",
        "List all song names by singers above the average age.",
        "SELECT song_name FROM singer WHERE age > (SELECT avg(age) FROM singer)",
    ),
    (
        "concert_singer",
        "Show location and name for all stadiums with a capacity between 5000 and 10000.",
        "SELECT LOCATION , name FROM stadium WHERE capacity BETWEEN 5000 AND 10000",
    ),
    (
        "concert_singer",
        "Show the stadium name and the number of concerts in each stadium.",
        "SELECT T2.name , count(*) FROM concert AS T1 JOIN stadium AS T2 ON T1.stadium_id = T2.stadium_id "
        "GROUP BY T1.stadium_id",
    ),
    (
        "concert_singer",
        "Show the stadium name and capacity with most number of concerts in year 2014 or after.",
        "SELECT T2.name , T2.capacity FROM concert AS T1 JOIN stadium AS T2 ON T1.stadium_id = T2.stadium_id "
        "WHERE T1.year >= 2014 GROUP BY T2.stadium_id ORDER BY count(*) DESC LIMIT 1",
    ),
    (
        "concert_singer",
        "Which year has most number of concerts?",
        "SELECT YEAR FROM concert GROUP BY YEAR ORDER BY count(*) DESC LIMIT 1",
    ),
    (
        "concert_singer",
        "Show the stadium names without any concert.",
        "SELECT name FROM stadium WHERE stadium_id NOT IN (SELECT stadium_id FROM concert)",
    ),
    (
        "concert_singer",
        "Show countries where a singer above age 40 and a singer below 30 are from.",
        "SELECT country FROM singer WHERE age > 40 INTERSECT SELECT country FROM singer WHERE age < 30",
    ),
    (
        "concert_singer",
        "Show names for all stadiums except for stadiums having a concert in year 2014.",
        "SELECT name FROM stadium EXCEPT SELECT T2.name FROM concert AS T1 JOIN stadium AS T2 "
        "ON T1.stadium_id = T2.stadium_id WHERE T1.year = 2014",
    ),
    (
        "concert_singer",
        "List singer names and number of concerts for each singer.",
        "SELECT T2.name , count(*) FROM singer_in_concert AS T1 JOIN singer AS T2 ON T1.singer_id = T2.singer_id "
        "GROUP BY T2.singer_id",
    ),
    (
        "concert_singer",
        "List all singer names in concerts in year 2014.",
        "SELECT T2.name FROM singer_in_concert AS T1 JOIN singer AS T2 ON T1.singer_id = T2.singer_id "
        "JOIN concert AS T3 ON T1.concert_id = T3.concert_id WHERE T3.year = 2014",
    ),
    (
        "concert_singer",
        "What is the name and nation of the singer who have a song having 'Hey' in its name?",
        "SELECT name , country FROM singer WHERE song_name LIKE '%Hey%'",
    ),
    (
        "concert_singer",
        "Find the number of concerts happened in the stadium with the highest capacity.",
        "SELECT count(*) FROM concert WHERE stadium_id = (SELECT stadium_id FROM stadium ORDER BY capacity DESC LIMIT 1)",
    ),
    (
        "pets_1",
        "Find the number of pets whose weight is heavier than 10.",
        "SELECT count(*) FROM pets WHERE weight > 10",
    ),
    (
        "pets_1",
        "Find the weight of the youngest dog.",
        "SELECT weight FROM pets WHERE pettype = 'dog' ORDER BY pet_age LIMIT 1",
    ),
    (
        "pets_1",
        "Find the maximum weight for each type of pet. List the maximum weight and pet type.",
        "SELECT max(weight) , petType FROM pets GROUP BY petType",
    ),
    (
        "pets_1",
        "Find number of pets owned by students who are older than 20.",
        "SELECT count(*) FROM student AS T1 JOIN has_pet AS T2 ON T1.stuid = T2.stuid WHERE T1.age > 20",
    ),
    (
        "pets_1",
        "Find the average age of students who do not have any pet.",
        "SELECT avg(age) FROM student WHERE stuid NOT IN (SELECT stuid FROM has_pet)",
    ),
    ("pets_1", "Find the number of distinct type of pets.", "SELECT count(DISTINCT pettype) FROM pets"),
    (
        "pets_1",
        "Find the first name and age of students who have a pet.",
        "SELECT DISTINCT T1.fname , T1.age FROM student AS T1 JOIN has_pet AS T2 ON T1.stuid = T2.stuid",
    ),
    (
        "pets_1",
        "Find the major and age of students who do not have a cat pet.",
        "SELECT major , age FROM student WHERE stuid NOT IN (SELECT T1.stuid FROM student AS T1 JOIN has_pet AS T2 "
        "ON T1.stuid = T2.stuid JOIN pets AS T3 ON T3.petid = T2.petid WHERE T3.pettype = 'cat')",
    ),
    (
        "pets_1",
        "Find the average and maximum age for each type of pet.",
        "SELECT avg(pet_age) , max(pet_age) , pettype FROM pets GROUP BY pettype",
    ),
    (
        "pets_1",
        "For students who have pets, how many pets does each student have? List their ids instead of names.",
        "SELECT count(*) , T1.stuid FROM student AS T1 JOIN has_pet AS T2 ON T1.stuid = T2.stuid GROUP BY T1.stuid",
    ),
    ("employee_hire_evaluation", "How many employees are there?", "SELECT count(*) FROM employee"),
    (
        "employee_hire_evaluation",
        "Sort employee names by their age in ascending order.",
        "SELECT name FROM employee ORDER BY age",
    ),
    (
        "employee_hire_evaluation",
        "What is the number of employees from each city?",
        "SELECT count(*) , city FROM employee GROUP BY city",
    ),
    (
        "employee_hire_evaluation",
        "Which cities do more than one employee under age 30 come from?",
        "SELECT city FROM employee WHERE age < 30 GROUP BY city HAVING count(*) > 1",
    ),
    (
        "employee_hire_evaluation",
        "Find the manager name and district of the shop whose number of products is the largest.",
        "SELECT manager_name , district FROM shop ORDER BY number_products DESC LIMIT 1",
    ),
    (
        "employee_hire_evaluation",
        "Which employee received the most awards in evaluations? Give me the employee name.",
        "SELECT t1.name FROM employee AS t1 JOIN evaluation AS t2 ON t1.Employee_ID = t2.Employee_ID "
        "GROUP BY t2.Employee_ID ORDER BY count(*) DESC LIMIT 1",
    ),
    (
        "employee_hire_evaluation",
        "Find the names of employees who never won any award in the evaluation.",
        "SELECT name FROM employee WHERE Employee_ID NOT IN (SELECT Employee_ID FROM evaluation)",
    ),
    (
        "employee_hire_evaluation",
        "Which district has both stores with less than 3000 products and stores with more than 10000 products?",
        "SELECT district FROM shop WHERE Number_products < 3000 INTERSECT SELECT district FROM shop WHERE Number_products > 10000",
    ),
    # train split
    (
        "concert_singer",
        "How many concerts are there in year 2014 or 2015?",
        "SELECT count(*) FROM concert WHERE YEAR = 2014 OR YEAR = 2015",
    ),
    (
        "concert_singer",
        "What are the names of the singers that are not French?",
        "SELECT name FROM singer WHERE country != 'France'",
    ),
    (
        "pets_1",
        "How many dog pets are raised by female students?",
        "SELECT count(*) FROM student AS T1 JOIN has_pet AS T2 ON T1.stuid = T2.stuid JOIN pets AS T3 "
        "ON T2.petid = T3.petid WHERE T1.sex = 'F' AND T3.pettype = 'dog'",
    ),
    (
        "employee_hire_evaluation",
        "Find the total amount of bonus given in all the evaluations.",
        "SELECT sum(bonus) FROM evaluation",
    ),
]
NUM_TRAIN = 4


def _tables_json_entry(db_id: str, tables: dict[str, tuple]) -> dict:
    """The ``tables.json`` record Spider would have for this database (original and readable names)."""
    names = list(tables)
    columns_original: list[list] = [[-1, "*"]]
    types = ["text"]
    primary, foreign = [], []
    position: dict[tuple[str, str], int] = {}
    for t, (columns, pk, _, _) in enumerate(tables.values()):
        for column, kind in columns:
            position[(names[t].lower(), column.lower())] = len(columns_original)
            if column == pk:
                primary.append(len(columns_original))
            columns_original.append([t, column])
            types.append(kind)
    for table, (_, _, fks, _) in tables.items():
        for column, ref_table, ref_column in fks:
            foreign.append(
                [position[(table.lower(), column.lower())], position[(ref_table.lower(), ref_column.lower())]]
            )
    return {
        "db_id": db_id,
        "table_names_original": names,
        "table_names": [n.lower().replace("_", " ") for n in names],
        "column_names_original": columns_original,
        "column_names": [[t, c.lower().replace("_", " ")] for t, c in columns_original],
        "column_types": types,
        "primary_keys": primary,
        "foreign_keys": foreign,
    }


def _write_database(path: Path, tables: dict[str, tuple]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    conn = sqlite3.connect(path)
    try:
        for table, (columns, pk, fks, rows) in tables.items():
            defs = [f'"{c}" {"NUMERIC" if kind == "number" else "TEXT"}' for c, kind in columns]
            defs += [f'PRIMARY KEY ("{pk}")'] if pk else []
            defs += [f'FOREIGN KEY ("{c}") REFERENCES "{t}"("{rc}")' for c, t, rc in fks]
            conn.execute(f'CREATE TABLE "{table}" ({", ".join(defs)})')
            conn.executemany(f'INSERT INTO "{table}" VALUES ({", ".join("?" * len(columns))})', rows)
        conn.commit()
    finally:
        conn.close()


def write_example_spider(root: str | Path) -> Path:
    """Write tables.json, database/<db>/<db>.sqlite, dev.json and train_spider.json under ``root``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for db_id, tables in DATABASES.items():
        _write_database(root / "database" / db_id / f"{db_id}.sqlite", tables)
    entries = [_tables_json_entry(db_id, tables) for db_id, tables in DATABASES.items()]
    (root / "tables.json").write_text(json.dumps(entries, indent=1, ensure_ascii=False))
    records = [{"db_id": db, "question": q, "query": sql} for db, q, sql in QUESTIONS]
    (root / "dev.json").write_text(json.dumps(records[:-NUM_TRAIN], indent=1))
    (root / "train_spider.json").write_text(json.dumps(records[-NUM_TRAIN:], indent=1))
    return root


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m trainer.tasks.sql_example OUTPUT_DIR")
    print(write_example_spider(sys.argv[1]))
